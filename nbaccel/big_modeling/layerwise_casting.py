"""Layerwise casting: weights stored in a small dtype, cast up for each layer's forward only.

Accelerate's ``LayerwiseCastingHook`` and ``attach_layerwise_casting_hooks``: the linear and
convolution layers of a model keep their weights in ``storage_dtype`` (say ``float8_e4m3fn``)
and run in ``compute_dtype``, so the model takes the smaller dtype's memory at rest.

Differs from Accelerate: a single string ``skip_modules_pattern`` is one pattern (Accelerate
iterates it character by character).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from nbaccel.big_modeling.hooks import ModelHook, add_hook_to_module

__all__ = ["CASTABLE_LAYERS", "SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING", "LayerwiseCastingHook",
           "attach_layerwise_casting_hooks"]

CASTABLE_LAYERS: tuple[type[nn.Module], ...] = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d,
                                                nn.ConvTranspose2d, nn.ConvTranspose3d, nn.Linear)
"""The layer types that get a hook (the ones Accelerate casts)."""

SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING = CASTABLE_LAYERS
"""Accelerate's name for :data:`CASTABLE_LAYERS`."""


class LayerwiseCastingHook(ModelHook):
    """Keep a module's tensors in ``storage_dtype``; cast them to ``compute_dtype`` for its forward only.

    Example:
        >>> lin = add_hook_to_module(nn.Linear(2, 2), LayerwiseCastingHook(torch.bfloat16, torch.float32, False))
        >>> lin.weight.dtype, lin(torch.ones(1, 2)).dtype
        (torch.bfloat16, torch.float32)
    """

    def __init__(self, storage_dtype: torch.dtype, compute_dtype: torch.dtype, non_blocking: bool) -> None:
        self.storage_dtype = storage_dtype
        self.compute_dtype = compute_dtype
        self.non_blocking = non_blocking

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        module.to(dtype=self.compute_dtype, non_blocking=self.non_blocking)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)
        return output


def attach_layerwise_casting_hooks(module: nn.Module, storage_dtype: torch.dtype, compute_dtype: torch.dtype,
                                   skip_modules_pattern: str | Sequence[str] | None = None,
                                   skip_modules_classes: tuple[type[nn.Module], ...] | None = None,
                                   non_blocking: bool = False) -> None:
    """Give every linear and convolution layer of ``module`` a :class:`LayerwiseCastingHook`.

    Args:
        module: the model.
        storage_dtype: the dtype the weights are kept in.
        compute_dtype: the dtype each layer runs in.
        skip_modules_pattern: regular expressions; a layer whose dotted name matches one is left alone.
        skip_modules_classes: layer types left alone.
        non_blocking: cast asynchronously where the device allows.

    Example:
        >>> m = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2), nn.Linear(2, 1))
        >>> attach_layerwise_casting_hooks(m, torch.bfloat16, torch.float32, skip_modules_pattern=["^2$"])
        >>> m[0].weight.dtype, m[1].weight.dtype, m[2].weight.dtype, m(torch.ones(1, 2)).dtype
        (torch.bfloat16, torch.float32, torch.float32, torch.float32)
    """
    patterns = (skip_modules_pattern,) if isinstance(skip_modules_pattern, str) else tuple(skip_modules_pattern or ())
    _attach(module, storage_dtype, compute_dtype, patterns, skip_modules_classes or (), non_blocking, "")


def _attach(module: nn.Module, storage_dtype: torch.dtype, compute_dtype: torch.dtype, patterns: tuple[str, ...],
            skip_classes: tuple[type[nn.Module], ...], non_blocking: bool, name: str) -> None:
    if isinstance(module, skip_classes) or any(re.search(p, name) for p in patterns):
        return
    if isinstance(module, CASTABLE_LAYERS):
        add_hook_to_module(module, LayerwiseCastingHook(storage_dtype, compute_dtype, non_blocking), append=True)
        return
    for child_name, child in module.named_children():
        _attach(child, storage_dtype, compute_dtype, patterns, skip_classes, non_blocking,
                f"{name}.{child_name}" if name else child_name)
