"""Fork when safe, spawn otherwise: the decision, and spawn running __main__ code for real."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest

from nbaccel import EnvironmentStateError, PayloadPicklingError, notebook_launcher
from nbaccel.config import LaunchConfig
from nbaccel.launch.preflight import plan_launch

from .procs import children


def test_fork_is_chosen_when_safe():
    plan = plan_launch(LaunchConfig(num_processes=2))
    assert (plan.start_method, plan.start_reason) == ("fork", None)


def test_unsafe_fork_switches_to_spawn_and_says_why(monkeypatch):
    monkeypatch.setenv("NBACCEL_ASSUME_UNSAFE_FORK", "1")
    plan = plan_launch(LaunchConfig(num_processes=2))
    assert plan.start_method == "spawn"
    assert "spawn, not fork" in plan.start_reason and "NBACCEL_ASSUME_UNSAFE_FORK" in plan.start_reason


def test_forcing_fork_when_unsafe_is_refused(monkeypatch):
    monkeypatch.setenv("NBACCEL_ASSUME_UNSAFE_FORK", "1")
    with pytest.raises(EnvironmentStateError, match="start_method='spawn'"):
        notebook_launcher(print, num_processes=2, start_method="fork")


SPAWN_SCRIPT = """
    import os
    from nbaccel import notebook_launcher

    SCALE = 10

    class Point:
        def __init__(self, x):
            self.x = x

    def make_closure(offset):
        def inner(p):
            return p.x * SCALE + offset + int(os.environ["RANK"])
        return inner

    square = lambda v: v * v

    if __name__ == "__main__":
        results = notebook_launcher(make_closure(5), (Point(2),), num_processes=2, return_all=True)
        print("CLOSURE", results)
        print("LAMBDA", notebook_launcher(square, (7,), num_processes=2))
        print("CLASS", notebook_launcher(lambda: Point(3), num_processes=1).x)
"""


def test_spawn_runs_functions_classes_lambdas_and_closures_from_main(tmp_path):
    script = tmp_path / "spawned.py"
    script.write_text(textwrap.dedent(SPAWN_SCRIPT))
    env = {"NBACCEL_ASSUME_UNSAFE_FORK": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "CLOSURE {0: 25, 1: 26}" in done.stdout
    assert "LAMBDA 49" in done.stdout
    assert "CLASS 3" in done.stdout
    assert "starting workers with spawn, not fork" in done.stderr


def _uses_lock_global():
    return LOCK.locked()


LOCK = threading.Lock()


def test_unpicklable_argument_is_named_and_nothing_starts():
    with pytest.raises(PayloadPicklingError) as info:
        notebook_launcher(print, (1, threading.Lock()), num_processes=2, start_method="spawn")
    assert info.value.object_path == "args[1]"
    assert info.value.object_type == "_thread.lock"
    assert children() == []


def test_unpicklable_global_is_named():
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        with pytest.raises(PayloadPicklingError) as info:
            notebook_launcher(_uses_lock_global, num_processes=2, start_method="spawn")
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    assert info.value.object_path == "_uses_lock_global.__globals__['LOCK']"


def _rank_and_method():
    import multiprocessing
    import os

    return int(os.environ["RANK"]), multiprocessing.parent_process() is None


def test_spawned_workers_return_results_and_fail_like_forked_ones():
    assert notebook_launcher(_rank_and_method, num_processes=2, start_method="spawn", return_all=True) == \
        {0: (0, True), 1: (1, True)}
    with pytest.raises(ZeroDivisionError) as info:
        notebook_launcher(_divide_by_zero, num_processes=2, start_method="spawn")
    assert "_divide_by_zero" in info.value.__cause__.text


def _divide_by_zero():
    return 1 / 0


def test_cuda_tensors_in_a_spawn_payload_land_on_the_workers_own_gpu(monkeypatch):
    """A tensor saved on the notebook's cuda:3 is placed on this worker's GPU (LOCAL_RANK 1 of 2), never on cuda:3."""
    import io

    import cloudpickle
    import torch

    from nbaccel.launch.worker import trampoline

    placed: list[int] = []
    monkeypatch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:3")  # as saved on a GPU
    data = cloudpickle.dumps((len, (torch.arange(3.0),), {}))
    monkeypatch.undo()
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr("nbaccel.hardware.cuda_device_count", lambda: 2)
    monkeypatch.setattr(torch.UntypedStorage, "cuda", lambda self, index=None: placed.append(index) or self,
                        raising=False)
    function, args, _kwargs = trampoline.PayloadUnpickler(io.BytesIO(data)).load()
    assert placed == [1] and args[0].tolist() == [0.0, 1.0, 2.0] and function is len


def _touch_cuda_in_a_bad_fork() -> None:
    raise RuntimeError("Cannot re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, "
                       "you must use the 'spawn' start method")  # torch's own words in a poisoned child


def test_a_worker_that_meets_a_poisoned_fork_says_what_to_do():
    with pytest.raises(RuntimeError) as info:
        notebook_launcher(_touch_cuda_in_a_bad_fork, num_processes=2, start_method="fork", use_cpu=True)
    notes = [n for n in getattr(info.value, "__notes__", []) if n.startswith("nbaccel: this worker was forked")]
    assert len(notes) == 1 and "start_method='spawn'" in notes[0] and "restart the kernel" in notes[0]
