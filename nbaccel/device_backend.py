"""Accelerate's accelerator-backend helpers, answered for the devices nbaccel runs on (CUDA GPUs, else the CPU).

Which backend exists is asked of :mod:`nbaccel.hardware` (NVML, never initializing CUDA), so calling
these before a launch keeps fork safe; only :func:`get_accelerator_free_memory` touches a device,
as measuring free memory must. Apple's MPS is reported as Accelerate reports it. Accelerators nbaccel
has no engine for (NPU, XPU, HPU, MLU, ...) are never reported; the README lists those names.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

__all__ = ["TORCH_DISTRIBUTED_BACKENDS", "get_accelerator_free_memory", "get_current_device_type",
           "get_distributed_backend", "get_torch_accelerator_backend", "normalize_device"]

TORCH_DISTRIBUTED_BACKENDS: dict[str, str] = {"cuda": "nccl"}
"""The ``torch.distributed`` backend of each accelerator type nbaccel runs collectives on (CPU: gloo)."""


def get_torch_accelerator_backend(check_available: bool = True) -> tuple[str | None, ModuleType | None]:
    """``(device type, torch device module)`` of this machine's accelerator, ``(None, None)`` without one.

    Args:
        check_available: kept for Accelerate's signature; availability is always checked here,
            through NVML, so asking never initializes CUDA.

    Example:
        >>> get_torch_accelerator_backend()  # on a machine without GPUs  # doctest: +SKIP
        (None, None)
    """
    from nbaccel.hardware import cuda_device_count

    if cuda_device_count() > 0:
        return "cuda", torch.cuda
    if torch.backends.mps.is_available():
        return "mps", torch.mps
    return None, None


def get_distributed_backend(device_type: str | None) -> str | None:
    """The ``torch.distributed`` backend for ``device_type`` (``"nccl"`` for CUDA), ``None`` for others.

    Example:
        >>> get_distributed_backend("cuda"), get_distributed_backend(None)
        ('nccl', None)
    """
    return TORCH_DISTRIBUTED_BACKENDS.get(device_type) if device_type else None


def get_current_device_type() -> tuple[str, str]:
    """``(device type, distributed type name)``: ``("cuda", "MULTI_GPU")`` with GPUs, else ``("cpu", "NO")``.

    Example:
        >>> get_current_device_type()  # on a machine without GPUs  # doctest: +SKIP
        ('cpu', 'NO')
    """
    device_type, _ = get_torch_accelerator_backend(check_available=False)
    if device_type is None:
        return "cpu", "NO"
    if get_distributed_backend(device_type) is None:
        return device_type, "NO"
    return device_type, "MULTI_GPU"


def get_accelerator_free_memory(device_module: Any, device_index: int) -> int:
    """Free bytes on device ``device_index`` of ``device_module`` (``torch.cuda``, say); measuring initializes it.

    Example:
        >>> get_accelerator_free_memory(torch.cuda, 0)  # doctest: +SKIP
        84502347776
    """
    accelerator = getattr(torch, "accelerator", None)  # torch's device-generic module (torch >= 2.6)
    if accelerator is not None and device_module is accelerator and hasattr(accelerator, "get_memory_info"):
        return accelerator.get_memory_info(device_index)[0]
    return device_module.mem_get_info(device_index)[0]


def normalize_device(device: Any) -> Any:
    """``device`` as torch takes it: a bare index means a CUDA GPU, except on MPS (``"mps:0"``).

    Example:
        >>> normalize_device("cpu")
        'cpu'
    """
    if isinstance(device, int) and not isinstance(device, bool):
        device_type, _ = get_torch_accelerator_backend(check_available=False)
        if device_type not in (None, "cuda"):
            return f"{device_type}:{device}"
    return device
