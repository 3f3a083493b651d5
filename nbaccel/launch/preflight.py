"""Preflight: turn a `LaunchConfig` into concrete choices, or fail before anything starts.

It picks the device kind, the number of workers, the start method (fork when safe, else spawn, with
the reason) and every worker's settings, without initializing CUDA or the XLA runtime.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Literal

from nbaccel.config import LaunchConfig, StartMethod
from nbaccel.environment import WorkerSettings
from nbaccel.errors import ConfigError, EnvironmentStateError
from nbaccel.hardware import (
    available_cpu_memory,
    cpu_count,
    cuda_device_count,
    fork_unsafe_reason,
    open_file_budget,
    tpu_detected,
)

__all__ = ["DeviceKind", "LaunchPlan", "plan_launch", "say", "settings_for", "wants_xla"]

DeviceKind = Literal["cpu", "cuda", "xla"]  # "xla": planned by the xla backend (xla/topology.py)
_MAX_AUTO_CPU_WORKERS = 4
# Descriptors the launching process holds per worker: three pipes (both ends while starting), a
# pidfd, and the rendezvous store's connection; a few spare for the store and the caller.
_FDS_PER_WORKER = 8
_SPARE_FDS = 32
# The least a CPU worker costs once it has touched torch and joined a gloo group; a request that
# cannot get this much per worker would exhaust memory (or the OOM killer) rather than run.
_MIN_CPU_WORKER_MEMORY = 64 * 2**20


@dataclass(frozen=True)
class LaunchPlan:
    """The concrete choices for one launch.

    Attributes:
        num_processes: workers on this machine.
        device_kind: ``"cpu"``, ``"cuda"`` or ``"xla"``.
        start_method: ``"fork"`` or ``"spawn"``.
        start_reason: why spawn was chosen when fork was not asked against (``None`` otherwise).
        settings: what every worker reads back with ``read_worker_settings()``.
        visible_gpus: ``CUDA_VISIBLE_DEVICES`` for the workers, if restricted.
        threads: ``OMP_NUM_THREADS`` per worker.
        note: a one-line message for the user (a chosen worker count, a start-method switch).
    """

    num_processes: int
    device_kind: DeviceKind
    start_method: StartMethod
    start_reason: str | None
    settings: WorkerSettings
    visible_gpus: str | None
    threads: int
    note: str | None


def wants_xla(config: LaunchConfig) -> bool:
    """Whether ``config`` runs on XLA devices (asked for, or a TPU here), which the xla backend plans."""
    if config.use_cpu or config.distributed_type == "MULTI_CPU":
        return False
    return config.distributed_type == "XLA" or (config.distributed_type is None and tpu_detected())


def _device_kind(config: LaunchConfig) -> tuple[DeviceKind, int]:
    if config.use_cpu or config.distributed_type == "MULTI_CPU":
        return "cpu", 0
    if wants_xla(config):
        raise ConfigError("plan_launch plans this machine's CPU or CUDA processes, but this config runs on XLA "
                          "devices, whose replicas the xla backend counts. Fix: build_request(...) plans it, or "
                          "pass use_cpu=True.", key="distributed_type", value=config.distributed_type or "XLA",
                          valid=("MULTI_CPU", "MULTI_GPU", "NO"))
    gpus = cuda_device_count()
    if config.distributed_type == "MULTI_GPU" and gpus == 0:
        raise ConfigError("distributed_type='MULTI_GPU' but no CUDA device is visible. Fix: set "
                          "use_cpu=True (or distributed_type='MULTI_CPU') to run on CPU processes.",
                          key="distributed_type", value="MULTI_GPU", valid=("MULTI_CPU", "NO"))
    return ("cuda", gpus) if gpus else ("cpu", 0)


def _unused_gpus_note() -> list[str]:
    """Say so when the machine has GPUs that this torch cannot use (a CPU build)."""
    from nbaccel.cuda_probe import gpu_driver_present, nvml_gpus, torch_cuda_built

    found = nvml_gpus() if gpu_driver_present() and not torch_cuda_built() else None
    if not found or not found[1]:
        return []
    return [f"nbaccel: this machine has {len(found[1])} GPU(s) ({found[1][0].name}), but this torch has no CUDA "
            "support, so the launch runs on CPU processes. Fix: install a CUDA build of torch."]


def _gpu_ids(config: LaunchConfig, gpus: int) -> tuple[str | None, int, tuple[int, ...] | None]:
    from nbaccel.cuda_probe import (
        select_gpus,  # numbers count the GPUs this process sees; UUIDs name one
    )

    chosen = select_gpus(config.gpu_ids, gpus)
    return chosen.visible_devices, chosen.count, chosen.physical_ids


def _check_capacity(n: int, kind: DeviceKind) -> None:
    """Refuse, before anything is opened, a number of workers this process or machine cannot hold."""
    budget = open_file_budget()
    if budget is not None:
        free, limit = budget
        fit = max((free - _SPARE_FDS) // _FDS_PER_WORKER, 0)
        if n > fit:
            raise ConfigError(
                f"num_processes={n} needs about {n * _FDS_PER_WORKER + _SPARE_FDS} file descriptors in this "
                f"process, but it may open only {free} more (limit {limit}, `ulimit -n`). Fix: pass "
                f"num_processes<={fit}, or raise the limit (resource.setrlimit(resource.RLIMIT_NOFILE, ...)).",
                key="num_processes", value=n, valid=f"1..{fit}")
    if kind == "cpu":
        memory = available_cpu_memory()
        fit = max(memory // _MIN_CPU_WORKER_MEMORY, 1)
        if n > fit:
            raise ConfigError(
                f"num_processes={n} CPU workers need at least {n * _MIN_CPU_WORKER_MEMORY / 2**30:.1f} GiB "
                f"(about {_MIN_CPU_WORKER_MEMORY // 2**20} MiB each), but {memory / 2**30:.1f} GiB is available. "
                f"Fix: pass num_processes<={fit} (one per core, {cpu_count()} here, is usually fastest).",
                key="num_processes", value=n, valid=f"1..{fit}")


def _start_method(requested: StartMethod | None) -> tuple[StartMethod, str | None]:
    unsafe = fork_unsafe_reason()
    if requested == "spawn":
        return "spawn", None
    if requested == "fork":
        if unsafe is not None:
            raise EnvironmentStateError(
                f"start_method='fork' is unsafe here: {unsafe}. Fix: pass start_method='spawn' (or None to "
                "choose); to fork again, restart the kernel and launch before touching CUDA.")
        return "fork", None
    if unsafe is not None:
        return "spawn", f"nbaccel: starting workers with spawn, not fork: {unsafe}."
    return "fork", None


def plan_launch(config: LaunchConfig) -> LaunchPlan:
    """Decide how to run ``config`` on this machine.

    Raises:
        ConfigError: the config asks for hardware that is not here (GPUs, or fp8-capable ones), or for more
            workers than this process has file descriptors or this machine has memory for.
        MissingDependencyError: ``mixed_precision="fp8"`` without torchao.
        EnvironmentStateError: fork was requested but is unsafe in this process.
    """
    kind, gpus = _device_kind(config)
    visible, usable, physical = _gpu_ids(config, gpus) if kind == "cuda" else (None, 0, None)
    if config.mixed_precision == "fp8":  # refused here, not by each worker's Accelerator() after N started
        from nbaccel.fp8_support import check_fp8_launch

        check_fp8_launch(kind, physical)
    notes: list[str] = []
    n = config.num_processes
    if n is None:
        if kind == "cuda":
            n = usable
            notes.append(f"nbaccel: using {n} process{'es' if n > 1 else ''}, one per visible GPU. Pass "
                         "num_processes= to choose.")
        else:
            n = max(1, min(cpu_count(), _MAX_AUTO_CPU_WORKERS))
            notes.append(f"nbaccel: no GPU found; using {n} CPU processes (one per core, at most "
                         f"{_MAX_AUTO_CPU_WORKERS}). Pass num_processes= to choose.")
    if kind == "cpu" and not config.use_cpu and config.distributed_type != "MULTI_CPU":
        notes.extend(_unused_gpus_note())
    if kind == "cuda" and n > usable:
        raise ConfigError(f"num_processes={n} but only {usable} GPU(s) are usable. Fix: pass num_processes<="
                          f"{usable}, or use_cpu=True for CPU processes.", key="num_processes", value=n,
                          valid=f"1..{usable}")
    _check_capacity(n, kind)
    if kind == "cpu" and n > cpu_count():  # allowed (tests, debugging), but the user should know why it is slow
        notes.append(f"nbaccel: {n} CPU processes on {cpu_count()} cores: they take turns, so each runs slower. "
                     f"Pass num_processes<={cpu_count()} for one per core.")
    method, reason = _start_method(config.start_method)
    if reason:
        notes.append(reason)
    settings = settings_for(config, kind, n * config.num_machines)
    threads = max(1, cpu_count() // max(n, 1)) if kind == "cpu" else 1
    return LaunchPlan(num_processes=n, device_kind=kind, start_method=method, start_reason=reason,
                      settings=settings, visible_gpus=visible, threads=threads,
                      note="\n".join(notes) or None)


def settings_for(config: LaunchConfig, kind: DeviceKind, world_size: int) -> WorkerSettings:
    """What every worker of a ``world_size``-rank job on ``kind`` devices reads back as its settings."""
    if kind == "xla":
        dtype = "XLA"
    elif config.distributed_type in ("FSDP", "DEEPSPEED"):
        dtype = config.distributed_type
    elif world_size > 1:
        dtype = "MULTI_GPU" if kind == "cuda" else "MULTI_CPU"
    else:
        dtype = "NO"
    return WorkerSettings(
        mixed_precision=config.mixed_precision, use_cpu=config.use_cpu or kind == "cpu",
        distributed_type=dtype,  # type: ignore[arg-type]  # one of the DistributedType values set above
        num_machines=config.num_machines, fsdp_config=dict(config.fsdp_config),
        deepspeed_config=dict(config.deepspeed_config), debug=config.debug, launched=True)


def say(note: str | None) -> None:
    """Print a preflight note: to stderr, or to stdout in a Jupyter kernel, where stderr is the pink warning box."""
    if note:
        in_kernel = type(sys.stderr).__module__.startswith("ipykernel")
        print(note, file=sys.stdout if in_kernel else sys.stderr, flush=True)
