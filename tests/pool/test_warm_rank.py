"""Warm one-process ranks: repeated one-process launches reuse a kept rank, and each still sees a fresh run."""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time

import pytest
import torch

from nbaccel import Accelerator, WorkerFailedError, notebook_launcher
from nbaccel.errors import LaunchTimeoutError
from nbaccel.launch.pool import warm
from nbaccel.launch.request import build_request

from ..launch.procs import alive
from .helpers import wait_for


def _pid() -> int:
    return os.getpid()


def _launch(function, *args, **kwargs):
    return notebook_launcher(function, args, num_processes=1, use_cpu=True, **kwargs)


def test_a_one_process_launch_runs_on_a_kept_rank_unless_fresh():
    assert build_request(_pid, num_processes=1, use_cpu=True).launcher == "warm"
    assert build_request(_pid, num_processes=1, use_cpu=True, fresh=True).launcher == "local"
    assert build_request(_pid, num_processes=2, use_cpu=True).launcher == "local"
    first, second = _launch(_pid), _launch(_pid)
    assert first == second != os.getpid() and alive(first)
    fresh = _launch(_pid, fresh=True)
    assert fresh not in (first, os.getpid()) and not alive(fresh)
    info = warm.warm_rank_info()
    assert info is not None and (info.pid, info.device, info.runs) == (first, "cpu", 2)


def _leave_state_behind(marker: str) -> dict:
    from nbaccel import worker_namespace
    from nbaccel.state import is_initialized

    seen = {"env": os.environ.get("NBACCEL_TEST_MARK"), "cwd": os.getcwd(), "namespace": sorted(worker_namespace()),
            "state": is_initialized(), "dtype": str(torch.get_default_dtype()), "grad": torch.is_grad_enabled()}
    os.environ["NBACCEL_TEST_MARK"] = marker
    worker_namespace()["left"] = marker
    os.chdir("/")
    seen["mixed_precision"] = Accelerator(mixed_precision="bf16").mixed_precision
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    return seen


def test_each_launch_starts_from_the_caller_not_from_the_previous_launch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NBACCEL_TEST_MARK", "caller")
    first = _launch(_leave_state_behind, "first")
    second = _launch(_leave_state_behind, "second")
    for seen in (first, second):
        assert seen == {"env": "caller", "cwd": str(tmp_path), "namespace": ["__name__"], "state": False,
                        "mixed_precision": "bf16", "dtype": "torch.float32", "grad": True}
    monkeypatch.setenv("NBACCEL_TEST_MARK", "changed in the caller")
    assert _launch(_leave_state_behind, "third")["env"] == "changed in the caller"
    assert os.getcwd() == str(tmp_path) and torch.get_default_dtype() == torch.float32


def _draws() -> tuple[float, float, float]:
    import numpy

    return float(numpy.random.rand()), torch.rand(1).item(), random.random()


def test_random_numbers_are_those_a_fresh_worker_draws():
    """NumPy and torch continue the caller's generators (a fork copies them); Python reseeds ``random`` in a fork."""
    import numpy

    def seeded() -> None:
        random.seed(7)
        numpy.random.seed(7)
        torch.manual_seed(7)

    seeded()
    expected = _draws()
    pythons = set()
    for fresh in (True, False, False):
        seeded()
        drawn = _launch(_draws, fresh=fresh)
        assert drawn[:2] == expected[:2]
        pythons.add(drawn[2])
    assert len(pythons) == 3 and expected[2] not in pythons


def _raise_key_error() -> None:
    raise KeyError("missing")


def test_a_failure_raises_as_a_launch_does_and_the_next_launch_gets_a_new_rank():
    before = _launch(_pid)
    with pytest.raises(KeyError) as info:
        _launch(_raise_key_error)
    assert isinstance(info.value, WorkerFailedError) and info.value.failures[0].rank == 0
    assert "KeyError: 'missing'" in info.value.failures[0].traceback
    assert wait_for(lambda: not alive(before), 10)
    assert _launch(_pid) != before


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def test_an_interrupt_stops_the_run_and_the_rank(tmp_path):
    before = _launch(_pid)
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            _launch(_sleep, 60)
    finally:
        timer.cancel()
    assert wait_for(lambda: not alive(before), 10) and warm.warm_rank_info() is None
    assert _launch(_pid) != before


def test_the_timeout_stops_the_run_and_the_rank():
    before = _launch(_pid)
    with pytest.raises(LaunchTimeoutError) as info:
        _launch(_sleep, 60, timeout=1.0)
    assert info.value.reason == "timeout"
    assert wait_for(lambda: not alive(before), 10)


def test_other_settings_get_another_rank_and_the_old_one_is_closed():
    default = _launch(_pid)
    bf16 = notebook_launcher(_pid, num_processes=1, use_cpu=True, mixed_precision="bf16")
    assert bf16 != default and wait_for(lambda: not alive(default), 10)


def test_a_changed_user_module_gets_a_new_rank(tmp_path, monkeypatch):
    (tmp_path / "user_helpers_warm.py").write_text("import os\n\ndef where():\n    return os.getpid()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import user_helpers_warm

    try:
        first = _launch(user_helpers_warm.where)
        assert _launch(user_helpers_warm.where) == first
        edited = warm._warm.started_at + 1  # type: ignore[union-attr]  # a rank is warm: launched above
        os.utime(tmp_path / "user_helpers_warm.py", (edited, edited))  # saved after the rank started
        assert _launch(user_helpers_warm.where) != first
    finally:
        del sys.modules["user_helpers_warm"]  # its file's time is in the future: later ranks would see it change


def test_a_function_that_cannot_be_pickled_runs_in_a_fork():
    lock = threading.Lock()

    def uses_a_lock() -> int:
        with lock:
            return os.getpid()

    kept = _launch(_pid)
    forked = _launch(uses_a_lock)
    assert forked not in (kept, os.getpid()) and not alive(forked)
    assert _launch(_pid) == kept


def test_an_idle_rank_is_closed(monkeypatch):
    monkeypatch.setattr(warm, "IDLE_CLOSE_SECONDS", 0.5)
    pid = _launch(_pid)
    assert wait_for(lambda: not alive(pid), 10) and warm.warm_rank_info() is None


def test_a_launch_that_needs_the_gpu_takes_it_from_a_warm_gpu_rank():
    pid = _launch(_pid)
    kept = warm._warm
    assert kept is not None
    cpu_request = build_request(_pid, num_processes=2, use_cpu=True)
    warm.release_warm_devices(cpu_request)
    assert warm.warm_rank_info() is not None  # a CPU rank holds no device anyone waits for
    kept.device_kind = "cuda"  # as a rank started on a GPU machine would be
    gpu_plan = cpu_request.plan.__class__(**{**cpu_request.plan.__dict__, "device_kind": "cuda"})
    warm.release_warm_devices(cpu_request.__class__(**{**cpu_request.__dict__, "plan": gpu_plan}))
    assert warm.warm_rank_info() is None and wait_for(lambda: not alive(pid), 10)


def test_a_spawned_warm_rank_is_kept_too():
    """Where fork is unsafe (CUDA in use in the notebook), the kept rank is spawned once, then reused."""
    first = _launch(_pid, start_method="spawn")
    assert _launch(_pid, start_method="spawn") == first
    assert warm.warm_rank_info().start_method == "spawn"  # type: ignore[union-attr]  # one is warm
    assert _launch(_pid) != first  # other settings (fork): another rank
