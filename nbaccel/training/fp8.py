"""fp8 training: the model conversion; whether the machine can do it is :mod:`nbaccel.fp8_support`'s (re-exported).

As in Accelerate 1.16 with its torchao backend: the ``nn.Linear`` layers whose sizes are
multiples of 16, except the model's first and last ones (kept in higher precision for
stability), become torchao's ``Float8Linear``; everything else runs under bf16 autocast. fp8
matmuls need NVIDIA GPUs of compute capability 8.9 or newer (Ada, Hopper, Blackwell).

The checks live below the training pillar (the launch core asks them before any worker starts,
and must not import training code); they are re-exported here under their old names.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nbaccel.fp8_support import (
    FP8_MIN_CAPABILITY,
    check_fp8_device,
    check_fp8_launch,
    gpu_capabilities,
    require_torchao,
)

__all__ = ["FP8_MIN_CAPABILITY", "check_fp8_device", "check_fp8_launch", "convert_model_to_fp8",
           "fp8_layer_filter", "gpu_capabilities"]


def fp8_layer_filter(model: torch.nn.Module) -> Callable[[torch.nn.Module, str], bool]:
    """Accelerate's filter: ``nn.Linear`` layers with sizes divisible by 16, except the first and last."""
    linears = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    skipped = {linears[0], linears[-1]} if linears else set()

    def keep(module: torch.nn.Module, fqn: str) -> bool:
        if isinstance(module, torch.nn.Linear) and (module.in_features % 16 or module.out_features % 16):
            return False
        return fqn not in skipped

    return keep


def convert_model_to_fp8(model: torch.nn.Module) -> torch.nn.Module:
    """Swap ``model``'s eligible ``nn.Linear`` layers for torchao's ``Float8Linear``, in place.

    Example:
        >>> convert_model_to_fp8(model)   # doctest: +SKIP
    """
    require_torchao("Accelerator(mixed_precision='fp8')")
    from torchao.float8 import convert_to_float8_training

    convert_to_float8_training(model, module_filter_fn=fp8_layer_filter(model))
    return model
