"""Nothing outlives a pool: close(), interpreter exit, and a SIGKILLed owner all leave no worker running."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from nbaccel import WorkerPool

from ..launch.procs import alive, children, listening, socket_inodes
from .helpers import wait_for

OWNER = """
    import os, sys, time
    from nbaccel import WorkerPool
    pool = WorkerPool(num_processes=2, use_cpu=True, start_method={method!r})
    pool.run(print, "warm")
    print("PIDS", *pool.pids, flush=True)
    {then}
"""


def _pool_folders() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "nbaccel-pool-*")))


def test_close_leaves_no_process_port_or_folder_behind():
    before, folders = children(), _pool_folders()
    pool = WorkerPool(num_processes=2, use_cpu=True)
    sockets = socket_inodes(os.getpid())
    pids = pool.pids
    assert set(pids) <= set(children()) and len(_pool_folders() - folders) == 1
    pool.close()
    assert not any(alive(p) for p in pids) and children() == before
    assert _pool_folders() == folders
    assert not listening(sockets & socket_inodes(os.getpid()))


def _start_a_child() -> int:
    return subprocess.Popen(["sleep", "120"]).pid


def test_what_a_worker_started_ends_with_the_pool():
    pool = WorkerPool(num_processes=2, use_cpu=True)
    grandchildren = list(pool.run(_start_a_child, return_all=True).values())
    assert all(alive(p) for p in grandchildren)
    pool.close()
    assert wait_for(lambda: not any(alive(p) for p in grandchildren), 5)


def _owner(tmp_path: Path, method: str, then: str) -> tuple[subprocess.Popen, list[int]]:
    script = tmp_path / "owner.py"
    script.write_text(textwrap.dedent(OWNER.format(method=method, then=then)))
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    for line in owner.stdout:  # type: ignore[union-attr]  # stdout=PIPE: never None
        if line.startswith("PIDS"):
            return owner, [int(p) for p in line.split()[1:]]
    owner.wait()
    raise AssertionError(f"the owner exited with {owner.returncode} before its pool started")


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_sigkilled_owner_leaves_no_worker(tmp_path, method):
    owner, pids = _owner(tmp_path, method, "time.sleep(120)")
    assert all(alive(p) for p in pids)
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    assert wait_for(lambda: not any(alive(p) for p in pids), 10), [p for p in pids if alive(p)]


def test_an_owner_that_exits_without_closing_leaves_no_worker(tmp_path):
    owner, pids = _owner(tmp_path, "fork", "sys.exit(0)")
    assert owner.wait(timeout=30) == 0
    assert wait_for(lambda: not any(alive(p) for p in pids), 10)
