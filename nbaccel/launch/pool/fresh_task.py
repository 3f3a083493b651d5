"""A fresh run on a warm rank: what a newly forked worker would inherit, given to a rank that ran before.

A one-process launch forks a worker that starts from the caller as it is at that moment. A warm
rank (:mod:`nbaccel.launch.pool.warm`) was forked earlier and has run other tasks since, so each
task carries a :class:`CallerSnapshot` taken in the caller at launch time, and :func:`run_fresh`
puts the rank back into that state before the function runs and clears what the function left
after it returns (the README's "A repeated one-process launch" lists what is reset and what is
kept); the process itself is put back by :mod:`nbaccel.launch.pool.process_reset`. The caller
gets a :class:`FreshResult`: whether the rank must be replaced, and the user's modules the run
imported, which it then checks for edits.
"""

from __future__ import annotations

import gc
import os
import random
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import cloudpickle

from nbaccel.environment import replace_environment, without_outer_job
from nbaccel.launch.pool.process_reset import (
    begin_run,
    collect_garbage,
    end_run,
    freeze_long_lived,
    process_baseline,
)
from nbaccel.launch.pool.serve import worker_namespace
from nbaccel.launch.pool.user_modules import new_user_module_files
from nbaccel.rank_lifecycle import RankLifecycle
from nbaccel.launch.worker.display import route_figures, show_open_figures

__all__ = ["CallerSnapshot", "FreshResult", "run_fresh", "snapshot_caller"]

TORCH_DEFAULT_SEED = 67280421310721
"""The seed torch's generators start from in a new process (c10's ``default_rng_seed_val``)."""

# torch's global switches as a process that just imported torch has them.
_TORCH_DEFAULTS: dict[str, Any] = {
    "default_dtype": "float32", "grad_enabled": True, "deterministic": False, "matmul_precision": "highest",
    "cudnn_benchmark": False, "cudnn_deterministic": False, "cudnn_allow_tf32": True, "matmul_allow_tf32": False,
    "anomaly": (False, True),
    "print_options": {"precision": 4, "threshold": 1000, "edgeitems": 3, "linewidth": 80, "sci_mode": None},
}


@dataclass(frozen=True)
class CallerSnapshot:
    """What a worker forked from the caller now would start with (see the module docstring).

    Attributes:
        environ: the caller's environment with the rank's settings on top.
        cwd: the caller's working directory.
        sys_path: the caller's import path.
        numpy_rng: NumPy's global state, where the caller imported NumPy.
        torch_rng: torch's CPU generator state, where the caller imported torch.
        torch_seed: the seed torch's CUDA generators start from in a fork (the caller's last
            ``torch.manual_seed``, else torch's default).
        torch_switches: torch's global switches (names of :data:`_TORCH_DEFAULTS`).
    """

    environ: dict[str, str]
    cwd: str
    sys_path: list[str]
    numpy_rng: Any = None
    torch_rng: Any = None
    torch_seed: int = TORCH_DEFAULT_SEED
    torch_switches: dict[str, Any] = field(default_factory=lambda: dict(_TORCH_DEFAULTS))


def snapshot_caller(rank_environment: Mapping[str, str]) -> CallerSnapshot:
    """The caller's state now (run in the caller, at launch), with ``rank_environment`` on top of its environment.

    An outer job's rank variables are left out: a launch from inside a rank is its own job.

    Example:
        >>> snapshot_caller({"RANK_SETTING": "1"}).environ["RANK_SETTING"]
        '1'
    """
    numpy = sys.modules.get("numpy")
    torch = sys.modules.get("torch")
    return CallerSnapshot(
        environ={**without_outer_job(os.environ), **rank_environment}, cwd=os.getcwd(), sys_path=list(sys.path),
        numpy_rng=numpy.random.get_state() if numpy is not None else None,
        torch_rng=torch.get_rng_state() if torch is not None else None,
        torch_seed=torch.initial_seed() if torch is not None else TORCH_DEFAULT_SEED,
        torch_switches=_torch_switches(torch) if torch is not None else dict(_TORCH_DEFAULTS))


class FreshResult(NamedTuple):
    """What a fresh run sends back: the function's value, and what the caller's side must know about the rank.

    Attributes:
        value: the function's return value.
        replace: why the rank must be replaced before the launch returns (``None``: it is reusable).
        module_files: the user's module files this run imported in the rank, first reported now.
    """

    value: Any
    replace: str | None = None
    module_files: tuple[str, ...] = ()


def run_fresh(snapshot: CallerSnapshot, task: bytes, lifecycle: bytes) -> FreshResult:
    """In the warm rank: take ``snapshot``'s state, run the pickled ``(function, args, kwargs)``, clear what it left.

    The rank starts afresh through the cloudpickled ``lifecycle`` (the launch's) before the function.

    The task is loaded here, after :func:`freeze_long_lived`, so its function's and arguments'
    objects are never frozen.
    """
    baseline = process_baseline()
    freeze_long_lived()
    function, args, kwargs = cloudpickle.loads(task)
    _restore(snapshot, cloudpickle.loads(lifecycle))
    start = begin_run()
    ok = False
    try:
        value = function(*args, **kwargs)
        ok = True
    finally:
        sys.setrecursionlimit(baseline.recursion_limit)  # first: the clean-up recurses, whatever the run left
        del function, args, kwargs
        _clean_up(show_figures=ok)
        replace = end_run(baseline, start)
    return FreshResult(value, replace, new_user_module_files(start.module_count))


def _restore(snapshot: CallerSnapshot, lifecycle: RankLifecycle) -> None:
    replace_environment(snapshot.environ)
    route_figures(os.environ)  # the rank's figure backend, as its process setup chose it
    os.chdir(snapshot.cwd)
    sys.path[:] = snapshot.sys_path
    lifecycle.start_afresh()
    worker_namespace().clear()
    worker_namespace()["__name__"] = "__main__"
    random.seed()  # what os.fork does for Python's generator in every child
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        if snapshot.numpy_rng is not None:
            numpy.random.set_state(snapshot.numpy_rng)
        else:
            numpy.random.seed()  # a fresh import seeds from the OS
    torch = sys.modules.get("torch")
    if torch is not None:
        if snapshot.torch_rng is not None:
            torch.set_rng_state(snapshot.torch_rng)
        else:
            torch.manual_seed(TORCH_DEFAULT_SEED)
        torch.cuda.manual_seed_all(snapshot.torch_seed)  # queued until CUDA starts, as in a fork
        _set_torch_switches(torch, snapshot.torch_switches)


def _clean_up(show_figures: bool) -> None:
    if show_figures:
        show_open_figures()
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is not None:
        pyplot.close("all")
    worker_namespace().clear()
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        gc.collect()  # modules holding the group first: destroying gloo under them can deadlock
        dist.destroy_process_group()
    collect_garbage()  # what the function built is garbage now, cycles included
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        _release_gpu_memory(torch)


def _release_gpu_memory(torch: Any) -> None:
    """Cached GPU memory back to the device, peak statistics reset, and the pinned host cache emptied."""
    torch.cuda.empty_cache()  # the GPU memory goes back to the device, not just to torch's cache
    for device in range(torch.cuda.device_count()):
        torch.cuda.reset_peak_memory_stats(device)  # max_memory_allocated() in the next run is that run's
    host_empty_cache = getattr(torch._C, "_host_emptyCache", None)  # pinned host blocks (torch >= 2.1)
    if host_empty_cache is not None:
        host_empty_cache()


def _torch_switches(torch: Any) -> dict[str, Any]:
    return {
        "default_dtype": str(torch.get_default_dtype()).removeprefix("torch."),
        "grad_enabled": torch.is_grad_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "anomaly": (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        "print_options": dict(vars(torch._tensor_str.PRINT_OPTS)),
    }


def _set_torch_switches(torch: Any, switches: Mapping[str, Any]) -> None:
    if _torch_switches(torch) == switches:
        return
    torch.set_default_dtype(getattr(torch, switches["default_dtype"]))
    torch.set_grad_enabled(switches["grad_enabled"])
    torch.use_deterministic_algorithms(switches["deterministic"])
    torch.set_float32_matmul_precision(switches["matmul_precision"])
    torch.backends.cudnn.benchmark = switches["cudnn_benchmark"]
    torch.backends.cudnn.deterministic = switches["cudnn_deterministic"]
    torch.backends.cudnn.allow_tf32 = switches["cudnn_allow_tf32"]
    torch.backends.cuda.matmul.allow_tf32 = switches["matmul_allow_tf32"]
    torch.set_anomaly_enabled(*switches["anomaly"])
    vars(torch._tensor_str.PRINT_OPTS).update(switches["print_options"])
