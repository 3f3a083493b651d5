"""CUDA facts learned without initializing CUDA here: the device count, whether fork is still safe, which GPUs.

``torch.cuda.is_initialized()`` is not enough to decide fork: ``torch.cuda.is_available()``
(without ``PYTORCH_NVML_BASED_CUDA_CHECK=1``), ``torch.cuda.device_count()`` when NVML cannot
count (no driver library, MIG UUIDs in ``CUDA_VISIBLE_DEVICES``), and every library that calls
them run ``cudaGetDeviceCount``. That "poisons" fork: torch registers a fork handler, and every
forked child then fails with "Cannot re-initialize CUDA in forked subprocess", while the parent
still reports ``is_initialized() == False``. The poison is only visible in a child, so
:func:`cuda_fork_poisoned` forks a throwaway child that reports it and exits at once.

What always holds: nothing here calls ``cudaGetDeviceCount`` or ``cuInit`` in the calling
process (unless CUDA is initialized or poisoned there already, when asking costs nothing more);
a probe child never runs Python cleanup or flushes the parent's buffers (it leaves by
``os._exit``), and never outlives its call.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from nbaccel.errors import ConfigError

if TYPE_CHECKING:
    from ctypes import CDLL

__all__ = ["GpuSelection", "NvmlGpu", "cuda_device_count", "cuda_fork_poisoned", "gpu_driver_present",
           "nccl_p2p_workaround", "nvml_gpus", "run_in_fork", "select_gpus", "torch_cuda_built"]

_PROBE_TIMEOUT_S = 20.0
_REAP_TIMEOUT_S = 5.0  # after SIGKILL: only a process stuck in the kernel takes longer
_MAX_COUNT = 200  # exit statuses carry 0..255; 255 means the probe itself failed


def run_in_fork(probe: Callable[[], int], timeout: float = _PROBE_TIMEOUT_S) -> int | None:
    """Run ``probe()`` in a throwaway forked child and return what it returned (0..254).

    Returns ``None`` when the child could not start, raised, died of a signal, or ran past
    ``timeout`` (it is killed then; one that SIGKILL does not end within 5 s is left, with a warning).

    Example:
        >>> run_in_fork(lambda: 7)
        7
    """
    if not hasattr(os, "fork"):  # pragma: no cover - not POSIX
        return None
    with warnings.catch_warnings():  # Python 3.12+ warns about fork in a threaded process (a kernel)
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            pid = os.fork()
        except OSError:
            return None
    if pid == 0:  # the child: answer through the exit status, run nothing else
        code = 255
        try:
            code = max(0, min(int(probe()), 254))
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    pause = 0.0005
    killed = False
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            if killed:  # SIGKILL did not end it: stuck in the kernel (a hung driver call); not waited for forever
                warnings.warn(f"the GPU probe (pid {pid}) did not exit within {_REAP_TIMEOUT_S:g}s of SIGKILL: it is "
                              "stuck in the kernel, most likely in a hung GPU driver call, so nbaccel stopped waiting "
                              f"and counts no GPU. Fix: see where it waits with `cat /proc/{pid}/stack`; `nvidia-smi` "
                              "hanging too means the driver needs a reset or the machine a restart", stacklevel=2)
                return None
            os.kill(pid, signal.SIGKILL)
            killed, deadline = True, time.monotonic() + _REAP_TIMEOUT_S
        time.sleep(pause)
        pause = min(pause * 2, 0.005)
    code = os.waitstatus_to_exitcode(status)
    return code if 0 <= code < 255 and not killed else None


def _cuda_built() -> bool:
    """Whether torch is imported here and built with CUDA (a CPU build can never poison fork)."""
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.cuda._is_compiled())


@functools.lru_cache(maxsize=1)
def gpu_driver_present() -> bool:
    """Whether an NVIDIA (NVML loads) or AMD (``/dev/kfd``) GPU driver is on this machine.

    Without one no torch build can see a GPU, so the count is 0 without importing torch (which
    takes seconds). Loading NVML initializes no CUDA context and keeps fork safe. Cached: drivers
    do not come and go while a process runs.

    Example:
        >>> gpu_driver_present()   # no GPU driver here
        False
    """
    return _nvml() is not None or os.path.exists("/dev/kfd")


@functools.lru_cache(maxsize=1)
def _nvml() -> CDLL | None:
    """NVML's library, loaded once for every question asked of it here (``None``: no NVIDIA driver)."""
    from ctypes import CDLL

    try:
        return CDLL("libnvidia-ml.so.1")
    except OSError:
        return None


def _torch_with_cuda() -> ModuleType | None:  # None: no GPU driver, no torch, or a CPU build
    torch: Any = sys.modules.get("torch")  # Any: the `import torch` below rebinds it to the module
    if torch is None:
        if not gpu_driver_present() or importlib.util.find_spec("torch") is None:
            return None
        # Importing torch starts no CUDA context and keeps fork safe; it makes the answer the same
        # whether or not the kernel imported torch first (it used to be "0 GPUs" until it had).
        import torch
    return torch if torch.cuda._is_compiled() else None


def torch_cuda_built() -> bool:
    """Whether the installed torch can use CUDA (imported only where a GPU driver is present).

    Example:
        >>> torch_cuda_built()   # no GPU driver here, or a CPU build
        False
    """
    return _torch_with_cuda() is not None


def cuda_fork_poisoned() -> bool:
    """Whether a process forked from this one could not use CUDA ("Cannot re-initialize CUDA in forked subprocess").

    ``False`` at no cost when torch is not imported or has no CUDA; otherwise one throwaway
    fork (a few milliseconds) asks torch's bad-fork flag in the child.

    Example:
        >>> cuda_fork_poisoned()   # on a CPU-only torch
        False
    """
    if not _cuda_built():
        return False
    import torch

    if torch.cuda._is_in_bad_fork():  # this process is itself a poisoned child
        return True
    return run_in_fork(lambda: 1 if torch.cuda._is_in_bad_fork() else 0) == 1


def _nvml_count() -> int:
    """torch's NVML (AMD SMI on ROCm) count honouring ``CUDA_VISIBLE_DEVICES``; negative when it cannot count."""
    import torch

    counter = getattr(torch.cuda, "_device_count_amdsmi" if torch.version.hip else "_device_count_nvml", None)
    if counter is None:  # pragma: no cover - a torch without the private counter
        return -1
    with warnings.catch_warnings():  # "Can't initialize NVML" where no driver is installed
        warnings.simplefilter("ignore")
        try:
            return int(counter())
        except Exception:  # noqa: BLE001 - any NVML failure means "cannot count here"
            return -1


def cuda_device_count() -> int:
    """Visible CUDA devices, counted without initializing CUDA (or poisoning fork) in this process.

    NVML counts first (as ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` does). Where it cannot (no NVML,
    MIG UUIDs), torch would fall back to ``cudaGetDeviceCount`` here and poison fork; the count
    is taken in a throwaway child instead, unless CUDA is initialized or poisoned here already.
    torch is imported for the count where a GPU driver is present and it is not imported yet, so
    the answer does not depend on what was imported before.

    Example:
        >>> cuda_device_count()   # on a CPU-only torch
        0
    """
    torch = _torch_with_cuda()
    if torch is None:
        return 0

    if torch.cuda.is_initialized():
        return torch.cuda.device_count()
    count = _nvml_count()
    if count >= 0:
        return count
    if cuda_fork_poisoned():
        return torch.cuda.device_count()
    counted = run_in_fork(lambda: min(torch.cuda.device_count(), _MAX_COUNT))
    return counted or 0


@dataclass(frozen=True)
class GpuSelection:
    """The GPUs a launch's ``gpu_ids`` select.

    Attributes:
        visible_devices: ``CUDA_VISIBLE_DEVICES`` for the workers (``None``: leave the caller's).
        count: how many GPUs that is.
        physical_ids: their NVML (physical) ids when known (``None`` for UUIDs).
    """

    visible_devices: str | None
    count: int
    physical_ids: tuple[int, ...] | None


def _bad_ids(gpu_ids: str, problem: str, fix: str, valid: object) -> ConfigError:
    return ConfigError(f"gpu_ids={gpu_ids!r} {problem}. Fix: {fix}", key="gpu_ids", value=gpu_ids, valid=valid)


def _physical(entries: list[str]) -> tuple[int, ...] | None:
    return tuple(int(e) for e in entries) if all(e.isdigit() for e in entries) else None


def select_gpus(gpu_ids: str, visible: int, env: Mapping[str, str] | None = None) -> GpuSelection:
    """Turn ``gpu_ids`` into the workers' ``CUDA_VISIBLE_DEVICES``, relative to what this process sees.

    A number in ``gpu_ids`` is a position among the GPUs this process sees (``cuda:N`` here), so
    with ``CUDA_VISIBLE_DEVICES=2,3`` in the notebook, ``gpu_ids="1"`` is physical GPU 3. A UUID
    (``GPU-...``, ``MIG-...``, or a unique prefix of one listed in ``CUDA_VISIBLE_DEVICES``) names
    a GPU directly.

    Args:
        gpu_ids: ``"all"`` or comma-separated positions and/or UUIDs.
        visible: how many GPUs this process sees.
        env: the environment holding ``CUDA_VISIBLE_DEVICES`` (default ``os.environ``).

    Raises:
        ConfigError: a position past the visible GPUs, an unknown or ambiguous UUID prefix, a
            repeated GPU (CUDA would then hide every GPU), or numbers mixed with UUIDs.

    Example:
        >>> select_gpus("1", 2, {"CUDA_VISIBLE_DEVICES": "2,3"}).visible_devices
        '3'
    """
    env = os.environ if env is None else env
    raw = env.get("CUDA_VISIBLE_DEVICES")
    parent = [p.strip() for p in raw.split(",")][:visible] if raw and raw.strip() else None
    if gpu_ids == "all":
        return GpuSelection(None, visible, _physical(parent) if parent is not None else tuple(range(visible)))
    chosen: list[str] = []
    for item in (p.strip() for p in gpu_ids.split(",")):
        if item.isdigit():
            if int(item) >= visible:
                seen = f" (CUDA_VISIBLE_DEVICES={raw})" if parent is not None else ""
                raise _bad_ids(gpu_ids, f"names GPU {item}, but only {visible} are visible{seen}; numbers count the "
                               f"GPUs this process sees, from 0", "set gpu_ids='all' or list existing ids",
                               list(range(visible)))
            chosen.append(parent[int(item)] if parent is not None else item)
            continue
        matches = ([p for p in parent if p.startswith(item)]
                   if parent is not None and not parent[0].isdigit() else [item])
        if len(matches) != 1:
            raise _bad_ids(gpu_ids, f"names {item!r}, which {'matches several' if matches else 'matches none'} of the "
                           f"visible GPUs {parent}", "give a full UUID from `nvidia-smi -L`", parent)
        chosen.append(matches[0])
    if len(set(chosen)) != len(chosen):
        raise _bad_ids(gpu_ids, f"selects a GPU twice ({','.join(chosen)}); CUDA would then hide every GPU",
                       "list each GPU once", "distinct ids")
    if len({e.isdigit() for e in chosen}) > 1:
        raise _bad_ids(gpu_ids, f"mixes numbers and UUIDs ({','.join(chosen)}), which CUDA_VISIBLE_DEVICES cannot "
                       "hold", "use only numbers or only UUIDs", "numbers or UUIDs")
    return GpuSelection(",".join(chosen), len(chosen), _physical(chosen))


@dataclass(frozen=True)
class NvmlGpu:
    """One physical GPU as NVML describes it (no CUDA context needed)."""

    name: str
    capability: tuple[int, int]


@functools.lru_cache(maxsize=1)
def nvml_gpus() -> tuple[str, tuple[NvmlGpu, ...]] | None:
    """The driver version and every physical GPU (NVML order), or ``None`` where NVML cannot tell.

    Reads NVML through ``ctypes`` (the one place nbaccel loads it; torch's own count goes through
    torch): CUDA is not initialized and fork stays safe. Cached: the
    hardware does not change while a kernel runs.

    Example:
        >>> nvml_gpus()   # no NVIDIA driver here
    """
    from ctypes import byref, c_int, c_void_p, create_string_buffer

    nvml = _nvml()
    if nvml is None:
        return None
    count, driver = c_int(0), create_string_buffer(96)
    if (nvml.nvmlInit_v2() != 0 or nvml.nvmlDeviceGetCount_v2(byref(count)) != 0
            or nvml.nvmlSystemGetDriverVersion(driver, 96) != 0):
        return None
    gpus = []
    for index in range(count.value):
        handle, major, minor, name = c_void_p(), c_int(0), c_int(0), create_string_buffer(96)
        if (nvml.nvmlDeviceGetHandleByIndex_v2(index, byref(handle)) != 0
                or nvml.nvmlDeviceGetName(handle, name, 96) != 0
                or nvml.nvmlDeviceGetCudaComputeCapability(handle, byref(major), byref(minor)) != 0):
            return None
        gpus.append(NvmlGpu(name.value.decode(errors="replace"), (major.value, minor.value)))
    return driver.value.decode(errors="replace"), tuple(gpus)


# Accelerate's list: consumer cards whose peer-to-peer / InfiniBand paths hang NCCL on older drivers.
_P2P_BROKEN = ("RTX 40",)
_P2P_FIXED_DRIVER = (550, 40, 7)


def nccl_p2p_workaround(info: tuple[str, tuple[NvmlGpu, ...]] | None = None) -> dict[str, str]:
    """``NCCL_P2P_DISABLE=1`` and ``NCCL_IB_DISABLE=1`` where several RTX 40xx cards run a driver before 550.40.07.

    Accelerate's rule (``check_cuda_p2p_ib_support``): NCCL hangs on peer-to-peer over those cards.

    Args:
        info: what :func:`nvml_gpus` returns (default: ask NVML).

    Example:
        >>> nccl_p2p_workaround(("535.104.05", (NvmlGpu("NVIDIA GeForce RTX 4090", (8, 9)),) * 2))
        {'NCCL_P2P_DISABLE': '1', 'NCCL_IB_DISABLE': '1'}
    """
    info = nvml_gpus() if info is None else info
    if info is None:
        return {}
    driver, gpus = info
    if len(gpus) < 2 or not any(marker in gpu.name for gpu in gpus for marker in _P2P_BROKEN):
        return {}
    try:
        version = tuple(int(part) for part in driver.split("."))
    except ValueError:
        version = ()
    if version and version >= _P2P_FIXED_DRIVER:
        return {}
    return {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1"}
