"""Undoing ``prepare``'s wrappers: the model under DDP, a DeepSpeed engine, ``torch.compile``, autocast."""

from __future__ import annotations

import torch

from nbaccel.training.deepspeed_engine import is_deepspeed_engine
from nbaccel.training.precision import unwrap_forward

__all__ = ["unwrap_model"]


def unwrap_model(model: torch.nn.Module, keep_fp32_wrapper: bool = True,
                 keep_torch_compile: bool = True) -> torch.nn.Module:
    """``model`` without the DDP / DeepSpeed wrappers ``prepare`` added (see ``Accelerator.unwrap_model``).

    Example:
        >>> inner = torch.nn.Linear(1, 1)
        >>> unwrap_model(inner) is inner
        True
    """
    compiled: torch.nn.Module | None = None
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel) or is_deepspeed_engine(model):
            compiled = None  # a compile wrapper around DDP cannot be kept without the DDP inside it
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
            compiled = model if compiled is None else compiled
            model = model._orig_mod
        else:
            break
    if not keep_fp32_wrapper:
        unwrap_forward(model)
    return compiled if keep_torch_compile and compiled is not None else model
