"""The fork decision sees a parent that only queried CUDA; nbaccel's own helpers never query it.

The parent is simulated in a subprocess (``tests/fake_cuda_runtime.py``): a CPU torch made to
look CUDA-built, whose ``cudaGetDeviceCount`` poisons fork exactly as torch's does (invisible in
the parent, ``_is_in_bad_fork()`` true in every child forked after it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nbaccel import cuda_probe
from nbaccel.cuda_probe import (
    NvmlGpu,
    cuda_device_count,
    cuda_fork_poisoned,
    nccl_p2p_workaround,
    run_in_fork,
    select_gpus,
)
from nbaccel.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = r"""
import json, os, torch
import tests.fake_cuda_runtime as fake
import nbaccel
from nbaccel.config import LaunchConfig
from nbaccel.hardware import cuda_device_count, fork_unsafe_reason
from nbaccel.launch.preflight import plan_launch

out = {"fresh": fork_unsafe_reason(), "count": cuda_device_count()}
nbaccel.set_seed(0)
accelerator = nbaccel.Accelerator()
out["device"] = str(accelerator.device)
accelerator.free_memory()
from nbaccel.training.random import capture_rng_state
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


def test_a_probe_that_sigkill_does_not_end_is_left_with_a_warning_not_waited_for(monkeypatch):
    """A probe stuck in the kernel (a hung driver call) survives SIGKILL; the caller must not hang on it.

    Such a process cannot be made here, so SIGKILL is withheld: to run_in_fork the real child looks the same.
    """
    children: list[int] = []
    monkeypatch.setattr(cuda_probe, "_REAP_TIMEOUT_S", 0.3)
    monkeypatch.setattr(cuda_probe.os, "kill", lambda pid, sig: children.append(pid))
    began = time.monotonic()
    try:
        with pytest.warns(UserWarning, match=r"did not exit within 0.3s of SIGKILL: it is stuck in the kernel.*Fix:"):
            assert run_in_fork(lambda: time.sleep(30), timeout=0.3) is None
        assert time.monotonic() - began < 5
    finally:
        monkeypatch.undo()
        for pid in children:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def test_cpu_only_torch_costs_no_fork():
    assert cuda_fork_poisoned() is False and cuda_device_count() == 0


# --------------------------------------------------------------------------- gpu_ids arithmetic


@pytest.mark.parametrize(("visible", "gpu_ids", "count", "expected", "physical"), [
    (None, "1,3", 4, "1,3", (1, 3)),
    ("2,3", "1", 2, "3", (3,)),
    ("4,5,6,7", "0,2", 4, "4,6", (4, 6)),
    ("7,5", "all", 2, None, (7, 5)),
    (None, "all", 3, None, (0, 1, 2)),
    ("MIG-1a2b,MIG-3c4d", "1", 2, "MIG-3c4d", None),
    ("GPU-aa11,GPU-bb22", "GPU-bb", 2, "GPU-bb22", None),
    (None, "GPU-0123-4567", 2, "GPU-0123-4567", None),
])
def test_gpu_ids_become_the_workers_visible_devices(visible, gpu_ids, count, expected, physical):
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    chosen = select_gpus(gpu_ids, count, env)
    assert (chosen.visible_devices, chosen.physical_ids) == (expected, physical)
    assert chosen.count == (count if gpu_ids == "all" else len(gpu_ids.split(",")))


@pytest.mark.parametrize(("visible", "gpu_ids", "count", "says"), [
    ("2,3", "2", 2, "names GPU 2, but only 2 are visible (CUDA_VISIBLE_DEVICES=2,3)"),
    ("GPU-aa11,GPU-aa22", "GPU-aa", 2, "matches several"),
    ("GPU-aa11,GPU-bb22", "GPU-cc", 2, "matches none"),
    (None, "1,1", 2, "selects a GPU twice"),
    ("2,3", "1,3", 2, "names GPU 3"),
    (None, "0,GPU-0123", 2, "mixes numbers and UUIDs"),
])
def test_impossible_gpu_ids_are_named(visible, gpu_ids, count, says):
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    with pytest.raises(ConfigError) as info:
        select_gpus(gpu_ids, count, env)
    assert info.value.key == "gpu_ids" and info.value.value == gpu_ids
    assert says in str(info.value) and "Fix:" in str(info.value)


# --------------------------------------------------------------------------- NCCL on consumer cards


_4090 = NvmlGpu("NVIDIA GeForce RTX 4090", (8, 9))


@pytest.mark.parametrize(("driver", "gpus", "disabled"), [
    ("535.104.05", (_4090, _4090), True),
    ("550.40.07", (_4090, _4090), False),
    ("560.35.03", (_4090, _4090), False),
    ("535.104.05", (_4090,), False),
    ("535.104.05", (NvmlGpu("NVIDIA H100 80GB HBM3", (9, 0)),) * 2, False),
])
def test_p2p_is_disabled_only_for_several_rtx_40xx_on_old_drivers(driver, gpus, disabled):
    expected = {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1"} if disabled else {}
    assert nccl_p2p_workaround((driver, gpus)) == expected


def test_gpu_workers_get_the_workaround_unless_the_user_chose(monkeypatch):
    from nbaccel import cuda_probe
    from nbaccel.environment import WorkerSettings, worker_environment

    monkeypatch.setattr(cuda_probe, "nvml_gpus", lambda: ("535.104.05", (_4090, _4090)))
    gpu_job = WorkerSettings(distributed_type="MULTI_GPU")
    assert worker_environment(gpu_job)["NCCL_P2P_DISABLE"] == "1"
    assert "NCCL_P2P_DISABLE" not in worker_environment(WorkerSettings(distributed_type="MULTI_CPU", use_cpu=True))
    monkeypatch.setenv("NCCL_P2P_DISABLE", "0")
    assert "NCCL_P2P_DISABLE" not in worker_environment(gpu_job)
