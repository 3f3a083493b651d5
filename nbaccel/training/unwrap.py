"""Undoing ``prepare``'s wrappers: the model under DDP / DataParallel, a DeepSpeed engine, torch.compile, autocast."""

from __future__ import annotations

from typing import cast

import torch

from nbaccel.training.deepspeed_engine import is_deepspeed_engine
from nbaccel.training.precision import unwrap_forward

__all__ = ["extract_model_from_parallel", "has_compiled_regions", "is_compiled_module", "unwrap_model"]


def is_compiled_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` is ``torch.compile``'s wrapper (an ``OptimizedModule``).

    Example:
        >>> is_compiled_module(torch.nn.Linear(1, 1))
        False
    """
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(module, OptimizedModule)


def has_compiled_regions(module: torch.nn.Module) -> bool:
    """Whether ``module`` has submodules (or is one) compiled with ``torch.compile``,
    as regional compilation leaves them.

    Example:
        >>> has_compiled_regions(torch.nn.Sequential(torch.nn.Linear(1, 1)))
        False
    """
    return bool(module._modules) and any(is_compiled_module(m) for m in module.modules())


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
        if (isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel))
                or is_deepspeed_engine(model)):
            model = cast(torch.nn.Module, model.module)  # DDP, DataParallel and DeepSpeed's engine wrap a Module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
            compiled = model if compiled is None else compiled
            model = model._orig_mod
        else:
            break
    if not keep_fp32_wrapper:
        unwrap_forward(model)
    if not keep_torch_compile or compiled is None:
        return model
    return compiled if compiled._orig_mod is model else _compiled_again(compiled, model)


def _compiled_again(compiled: torch.nn.Module, model: torch.nn.Module) -> torch.nn.Module:
    """``model`` under a compile wrapper like ``compiled`` (same dynamo settings), as Accelerate keeps it.

    Accelerate points ``compiled._orig_mod`` at the unwrapped model in place, which takes the DDP
    out of the prepared model too; a new wrapper leaves the prepared model as it was.
    """
    try:
        return type(compiled)(model, compiled.dynamo_ctx)  # torch's OptimizedModule(mod, dynamo_ctx)
    except (AttributeError, TypeError):  # a compile wrapper of another kind: the model alone
        return model


def _unwrap_tree(module: torch.nn.Module) -> torch.nn.Module:
    wrapped = getattr(module, "module", None)
    inner = _unwrap_tree(wrapped) if isinstance(wrapped, torch.nn.Module) else module
    for name, child in list(inner.named_children()):
        setattr(inner, name, _unwrap_tree(child))
    return inner


def extract_model_from_parallel(model: torch.nn.Module, keep_fp32_wrapper: bool = True,
                                keep_torch_compile: bool = True, recursive: bool = False) -> torch.nn.Module:
    """Accelerate's ``extract_model_from_parallel``: :func:`unwrap_model`, and with ``recursive`` every submodule too.

    ``recursive`` replaces each submodule that wraps another as ``.module`` (DDP, DataParallel,
    DeepSpeed, FSDP1-style wrappers) by the module inside it, throughout the tree.

    Example:
        >>> inner = torch.nn.Linear(1, 1)
        >>> extract_model_from_parallel(torch.nn.DataParallel(inner)) is inner
        True
    """
    model = unwrap_model(model, keep_fp32_wrapper=keep_fp32_wrapper, keep_torch_compile=keep_torch_compile)
    if recursive:
        compiled_inner = getattr(model, "_orig_mod", None)
        inner = compiled_inner if isinstance(compiled_inner, torch.nn.Module) else model
        for name, child in list(inner.named_children()):
            setattr(inner, name, _unwrap_tree(child))
    return model
