"""How many XLA replicas a launch would run, and whether it may start, without touching the runtime.

``torch_xla.launch`` runs one replica per XLA device: ``CPU_NUM_DEVICES`` on the CPU runtime, the
chips on the PCI bus (times two on TPU v2/v3) on a TPU, else whatever a throwaway child process
finds. The checks here run in the caller before anything forks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping

from nbaccel.config import LaunchConfig
from nbaccel.errors import (
    ConfigError,
    EnvironmentStateError,
    LaunchError,
    MissingDependencyError,
)
from nbaccel.hardware import (
    TPU_ENV_SIGNS,
    tpu_device_files,
    tpu_pci_device_ids,
    xla_installed,
    xla_runtime_initialized,
)
from nbaccel.launch.preflight import LaunchPlan, settings_for

__all__ = ["check_xla_launch", "plan_xla_launch", "probe_replica_count", "xla_replica_count"]

_CORES_PER_CHIP = {"0x0027": 2}  # TPU v2/v3 chips hold two XLA devices; later chips one
_PROBE = ("import torch_xla.runtime as xr, torch_xla.core.xla_model as xm; "
          "print(len(xm.get_xla_supported_devices()) * max(1, xr.local_process_count()))")



def _tpu_chips(root: str = "/") -> list[int]:
    """XLA devices per TPU chip on the PCI bus, one entry per chip."""
    return [_CORES_PER_CHIP.get(device, 1) for device in tpu_pci_device_ids(root)]


def _positive_env_int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"environment variable {name} must be a positive int (got {raw!r}). Fix: unset it, "
                          f"or set it to the number of XLA devices to use, e.g. {name}=1.", key=name, value=raw,
                          valid="a positive int")
    return value


def _process_bounds(env: Mapping[str, str]) -> int | None:
    raw = env.get("TPU_PROCESS_BOUNDS", "").strip()
    if not raw:
        return None
    size = 1
    for part in raw.split(","):
        if not part.strip().isdigit():
            return None  # not a bound torch_xla can use either; it reports that itself
        size *= int(part)
    return size


def probe_replica_count(timeout: float = 120.0) -> int:
    """Ask a throwaway child interpreter how many XLA devices the runtime reports.

    The child initializes the runtime (and, on a TPU, holds it until it exits); this process does
    not. Used when the count cannot be read from the environment or the PCI bus.

    Raises:
        LaunchError: the child failed or printed no count.
    """
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"asking the XLA runtime for its device count took over {timeout:g}s. Fix: set "
                          "num_processes=1, or check the runtime with `python -c 'import torch_xla; "
                          "print(torch_xla.device())'`.") from None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines or not lines[-1].isdigit():
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise LaunchError(f"could not ask the XLA runtime for its device count (exit code {done.returncode}):\n"
                          f"{tail}\nFix: check that `python -c 'import torch_xla; print(torch_xla.device())'` "
                          "works here, or pass num_processes=1.")
    return int(lines[-1])


def xla_replica_count(env: Mapping[str, str] | None = None, *, root: str = "/") -> int:
    """How many replicas ``torch_xla.launch`` would start here, without initializing the runtime.

    ``PJRT_DEVICE=CPU``: ``CPU_NUM_DEVICES`` (default 1). A TPU: the chips on the PCI bus (limited
    by ``TPU_PROCESS_BOUNDS``) times the devices per chip. Anything else is asked of a child
    process (:func:`probe_replica_count`).

    Example:
        >>> xla_replica_count({"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"})
        4
    """
    env = os.environ if env is None else env
    device = env.get("PJRT_DEVICE", "").upper().split("_")[0]
    chips = _tpu_chips(root) if device in ("", "TPU") else []
    if device == "CPU" or (device == "" and not chips):
        return _positive_env_int(env, "CPU_NUM_DEVICES") or 1
    if chips:  # PJRT_DEVICE=TPU, or unset on a TPU VM (torch_xla picks the TPU then)
        bounds = _process_bounds(env)
        used = chips[: bounds] if bounds else chips
        return sum(used)
    return probe_replica_count()


def check_xla_launch(num_processes: int | None, start_method: str | None,
                     env: Mapping[str, str] | None = None, *, root: str = "/") -> tuple[int, str | None]:
    """Validate an XLA launch request before anything starts: how many replicas to run, and a note.

    ``num_processes`` is honoured where the runtime can do it: 1 (one replica) or every device
    anywhere, any count on the CPU runtime. Elsewhere (a notebook written for a v3-8's 8 cores run
    on a 1-core v5e-1 or a 4-core v4-8) every device is used, as Accelerate does on TPUs, and the
    note says what ran.

    Returns:
        ``(replicas, note)``; ``note`` is ``None`` when the request ran as asked.

    Raises:
        MissingDependencyError: torch_xla is not installed.
        EnvironmentStateError: the XLA runtime is already initialized in this process, or TPU
            environment variables are set but no TPU chip is visible.
        ConfigError: ``start_method="spawn"``.
    """
    env = os.environ if env is None else env
    if not xla_installed():
        raise MissingDependencyError(
            "this launch runs through torch_xla (a TPU was detected or distributed_type='XLA'), but torch_xla "
            "is not installed. Fix: `pip install torch_xla` matching your torch version, or pass use_cpu=True "
            "(NBACCEL_TPU=0 turns TPU detection off).", package="torch_xla", needed_for="notebook_launcher on XLA",
            install="pip install torch_xla")
    if xla_runtime_initialized():
        raise EnvironmentStateError(
            "the XLA runtime is already initialized in this process (something used an XLA device: "
            "torch_xla.device(), xm.xla_device(), a tensor moved to 'xla'), so it holds the device and torch_xla "
            "cannot start replicas. Fix: restart the kernel and call notebook_launcher before touching the XLA "
            "device in the notebook.")
    if start_method == "spawn":
        raise ConfigError("start_method='spawn' is not supported on XLA: nbaccel runs torch_xla.launch with fork "
                          "so replicas get the function and their pipes from memory. Fix: pass start_method=None "
                          "or 'fork'.", key="start_method", value=start_method, valid=("fork", None))
    _check_tpu_visible(env, root)
    cpu_runtime = env.get("PJRT_DEVICE", "").strip().upper() == "CPU"
    if cpu_runtime and num_processes is not None:
        return num_processes, None  # the host sets CPU_NUM_DEVICES to it
    replicas = xla_replica_count(env, root=root)
    if num_processes is None or num_processes in (1, replicas):
        return num_processes or replicas, None
    return replicas, (f"nbaccel: num_processes={num_processes}, but this TPU has {replicas} XLA device"
                      f"{'s' if replicas != 1 else ''} and torch_xla runs one replica on each (or a single "
                      f"one): running {replicas}, as Accelerate does. Pass num_processes=None (all) or 1 to "
                      "choose.")


def _check_tpu_visible(env: Mapping[str, str], root: str) -> None:
    """Refuse a TPU launch that would silently run on torch_xla's CPU runtime: TPU variables, no chip."""
    pjrt = env.get("PJRT_DEVICE", "").strip().upper().split("_")[0]
    signs = [f"{k}={env[k]}" for k in TPU_ENV_SIGNS if env.get(k)]
    if pjrt not in ("", "TPU") or not (signs or pjrt == "TPU") or _tpu_chips(root) or tpu_device_files(root):
        return
    said = ", ".join(([f"PJRT_DEVICE={env['PJRT_DEVICE']}"] if pjrt else []) + signs)
    raise EnvironmentStateError(
        f"the environment says TPU ({said}) but no TPU chip is visible on this machine (none on the PCI bus, "
        "no /dev/accel* or /dev/vfio device), so torch_xla would run on its CPU runtime (or fail). Fix: on "
        "Colab or Kaggle choose a TPU runtime (Colab's old 'TPU (XRT)' runtimes are not supported by "
        "torch_xla 2.x); to use torch_xla's CPU runtime on purpose set PJRT_DEVICE=CPU; to train on this "
        "machine's CPUs pass use_cpu=True (NBACCEL_TPU=0 turns TPU detection off).")


def plan_xla_launch(config: LaunchConfig) -> LaunchPlan:
    """The xla backend's plan: ``torch_xla.launch`` with fork, over 1 or every device the runtime reports.

    Raises:
        ConfigError: ``mixed_precision="fp8"`` (XLA has none), or :func:`check_xla_launch`'s.
        MissingDependencyError: torch_xla is not installed.
        EnvironmentStateError: see :func:`check_xla_launch`.
    """
    if config.mixed_precision == "fp8":  # refused here, not by each replica's Accelerator()
        from nbaccel.fp8_support import check_fp8_launch

        check_fp8_launch("xla", None)
    n, note = check_xla_launch(config.num_processes, config.start_method)
    return LaunchPlan(num_processes=n, device_kind="xla", start_method="fork", start_reason=None,
                      settings=settings_for(config, "xla", n * config.num_machines), visible_gpus=None, threads=1,
                      note=note)
