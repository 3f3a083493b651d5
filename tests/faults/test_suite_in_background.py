"""Fault matrix, round two, the test-suite row: the interrupt tests pass when the suite runs as a background job.

A shell starts ``bash scripts/test.sh &`` with SIGINT ignored, and an ignored disposition is
inherited through fork and exec. The interrupt tests (one of a launch, one of a pool) are run
here in a pytest started exactly so, and must pass: tests/conftest.py puts Python's handler back.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INTERRUPT_TESTS = [
    "tests/launch/test_lifecycle.py::test_sigint_to_the_process_group_stops_every_worker_and_is_an_interrupt",
    "tests/pool/test_pool_failures.py::test_an_interrupt_cancels_the_task_in_every_rank_and_keeps_the_pool",
]


def _as_a_background_job() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # what `cmd &` does in a non-interactive shell


def test_the_interrupt_tests_pass_with_sigint_inherited_as_ignored():
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *INTERRUPT_TESTS],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, preexec_fn=_as_a_background_job,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "2 passed" in done.stdout
