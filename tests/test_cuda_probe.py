"""The fork decision sees a parent that only queried CUDA; nbaccel's own helpers never query it.

The parent is simulated in a subprocess (``tests/fake_cuda_runtime.py``): a CPU torch made to
look CUDA-built, whose ``cudaGetDeviceCount`` poisons fork exactly as torch's does (invisible in
the parent, ``_is_in_bad_fork()`` true in every child forked after it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from nbaccel.cuda_probe import cuda_device_count, cuda_fork_poisoned, run_in_fork

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = r"""
import json, os, torch
import tests.fake_cuda_runtime as fake
import nbaccel
from nbaccel.config import LaunchConfig
from nbaccel.environment import cuda_device_count, fork_unsafe_reason
from nbaccel.launch.preflight import plan_launch

out = {"fresh": fork_unsafe_reason(), "count": cuda_device_count()}
nbaccel.set_seed(0)
accelerator = nbaccel.Accelerator()
out["device"] = str(accelerator.device)
accelerator.free_memory()
from nbaccel.random import capture_rng_state
capture_rng_state()
out["after_helpers"] = fork_unsafe_reason()
out["parent_calls"] = len(fake.calls)
plan = plan_launch(LaunchConfig(num_processes=2))
out["plan_before"] = [plan.device_kind, plan.start_method]
out["available"] = torch.cuda.is_available()  # what a notebook cell does: cudaGetDeviceCount
out["initialized"] = torch.cuda.is_initialized()
out["poisoned"] = fork_unsafe_reason()
plan = plan_launch(LaunchConfig(num_processes=2))
out["plan_after"] = [plan.device_kind, plan.start_method, plan.note]
try:
    plan_launch(LaunchConfig(num_processes=2, start_method="fork"))
except Exception as exc:
    out["forced_fork"] = type(exc).__name__
print(json.dumps(out))
"""


def _simulated_parent() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_parent_that_only_queried_cuda_launches_with_spawn_and_says_why():
    out = _simulated_parent()
    assert out["fresh"] is None and out["plan_before"] == ["cuda", "fork"]
    assert out["available"] is True and out["initialized"] is False  # what the old check looked at
    assert "CUDA was queried in this process" in out["poisoned"]
    kind, method, note = out["plan_after"]
    assert (kind, method) == ("cuda", "spawn")
    assert note.count("\n") == 0 and note.startswith("nbaccel: starting workers with spawn, not fork: CUDA was queried")
    assert out["forced_fork"] == "EnvironmentStateError"


def test_nbaccel_helpers_count_gpus_without_poisoning_fork():
    out = _simulated_parent()
    assert out["count"] == 2 and out["device"] == "cuda:0"  # counted in a throwaway child
    assert out["parent_calls"] == 0 and out["after_helpers"] is None


def test_a_probe_child_answers_through_its_exit_status():
    assert run_in_fork(lambda: 7) == 7
    assert run_in_fork(lambda: 1 // 0) is None  # a raising probe is "no answer", not a crash here
    assert run_in_fork(lambda: os.kill(os.getpid(), 9)) is None


def test_a_hung_probe_is_killed_at_its_timeout():
    import time

    start = time.monotonic()
    assert run_in_fork(lambda: time.sleep(30), timeout=0.3) is None
    assert time.monotonic() - start < 5


def test_cpu_only_torch_costs_no_fork():
    assert cuda_fork_poisoned() is False and cuda_device_count() == 0
