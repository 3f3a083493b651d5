"""The ``fsdp2-shard-first`` GPU check's worker (``scripts/gpu_checks/workers.py``) on one CPU process over gloo.

On a GPU it also measures the memory peak; here the same code shards, materializes and
round-trips, so the first GPU session can run the check as it is.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbaccel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from gpu_checks import workers


def test_the_fsdp_shard_first_worker_runs_on_a_cpu_process():
    got = nbaccel.notebook_launcher(workers.fsdp_shard_first, num_processes=1, use_cpu=True, timeout=120)
    assert got["devices"] == ["cpu"] and got["dtypes"] == ["torch.float32"]
    assert got["meta_left"] == 0 and got["round_trip"]
