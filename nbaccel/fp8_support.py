"""Whether this machine and environment can train in fp8: checked at launch and in the worker.

fp8 matmuls need NVIDIA GPUs of compute capability 8.9 or newer (Ada, Hopper, Blackwell) and
torchao (Accelerate 1.16's backend). The launch-time check (:func:`check_fp8_launch`) reads
compute capabilities through NVML, so it neither initializes CUDA nor poisons fork; where NVML
cannot tell, the worker's check (:func:`check_fp8_device`) decides. Transformer Engine is
recognised but not driven by nbaccel: it is named in the refusal, with torchao as the fix.

This module is a fact about the machine, below both the launch core (which asks it before any
worker starts) and the training pillar (:mod:`nbaccel.training.fp8`, which converts models).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

import torch

from nbaccel.errors import ConfigError, MissingDependencyError

__all__ = ["FP8_MIN_CAPABILITY", "check_fp8_device", "check_fp8_launch", "gpu_capabilities", "require_torchao"]

FP8_MIN_CAPABILITY = (8, 9)
_INSTALL = "pip install torchao"


def require_torchao(needed_for: str) -> None:
    """Raise :class:`MissingDependencyError` (naming Transformer Engine if it is installed) unless torchao is."""
    if importlib.util.find_spec("torchao") is not None:
        return
    has_te = importlib.util.find_spec("transformer_engine") is not None
    found = " (transformer_engine is installed, but nbaccel drives fp8 through torchao only)" if has_te else ""
    raise MissingDependencyError(f"mixed_precision='fp8' needs torchao, which is not installed{found}. Fix: "
                                 f"`{_INSTALL}`, or use mixed_precision='bf16'", package="torchao",
                                 needed_for=needed_for, install=_INSTALL)


def _refuse(where: str, capability: tuple[int, int] | None, value: object) -> ConfigError:
    have = f"compute capability {capability[0]}.{capability[1]}" if capability else "no CUDA GPU"
    return ConfigError(f"mixed_precision='fp8' needs NVIDIA GPUs of compute capability "
                       f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} or newer (Ada, Hopper, Blackwell), "
                       f"but {where} "
                       f"has {have}. Fix: use mixed_precision='bf16' (or 'fp16' on GPUs without bf16)",
                       key="mixed_precision", value=value, valid=("no", "fp16", "bf16"))


def gpu_capabilities(physical_ids: Sequence[int] | None = None) -> list[tuple[int, int]] | None:
    """Compute capabilities of the GPUs with these physical (NVML) ids, or of all; ``None`` when NVML cannot tell.

    Example:
        >>> gpu_capabilities()   # no NVIDIA driver here
    """
    from nbaccel.cuda_probe import nvml_gpus

    info = nvml_gpus()
    if info is None:
        return None
    gpus = info[1]
    ids = range(len(gpus)) if physical_ids is None else physical_ids
    return [gpus[i].capability for i in ids] if all(0 <= i < len(gpus) for i in ids) else None


def check_fp8_launch(device_kind: str, physical_ids: Sequence[int] | None) -> None:
    """Refuse an fp8 launch before any worker starts: no CUDA GPUs, GPUs too old, or no torchao.

    Args:
        device_kind: the launch's device kind (``"cuda"``, ``"cpu"``, ``"xla"``).
        physical_ids: the NVML ids of the GPUs the workers will use (``None``: every GPU).

    Raises:
        ConfigError: the workers would run on CPU/XLA, or on a GPU older than compute capability 8.9.
        MissingDependencyError: torchao is not installed.
    """
    if device_kind != "cuda":
        raise _refuse(f"this launch runs on {device_kind.upper()}", None, "fp8")
    capabilities = gpu_capabilities(physical_ids)
    oldest = min(capabilities) if capabilities else None
    if oldest is not None and oldest < FP8_MIN_CAPABILITY:
        raise _refuse("a GPU of this launch", oldest, "fp8")
    require_torchao("mixed_precision='fp8'")


def check_fp8_device(device: torch.device) -> None:
    """The worker's check (CUDA is in use there already): the device can run fp8 and torchao is here.

    Raises:
        ConfigError: ``device`` is not a CUDA GPU of compute capability 8.9 or newer.
        MissingDependencyError: torchao is not installed.
    """
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if capability is None or capability < FP8_MIN_CAPABILITY:
        raise _refuse(f"this process's device ({device})", capability, "fp8")
    require_torchao("Accelerator(mixed_precision='fp8')")
