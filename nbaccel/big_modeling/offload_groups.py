"""Which offloaded hooks stream together: one group per no-split block (a decoder layer with its
norms, attention and MLP), so each slot holds a block and a forward copies each block once.

A hook outside every no-split block is a group of its own (an embedding, a final norm, a head).
The no-split classes are those given (``no_split_module_classes``) and a transformers model's
``_no_split_modules``, the same classes a device map keeps whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from nbaccel.big_modeling.streamed_offload import OFFLOAD_SLOTS, stream_offloaded

__all__ = ["block_of", "no_split_classes", "stream_model"]


def block_of(model: nn.Module, site: str, no_split: Sequence[str]) -> str | None:
    """The outermost no-split module holding hook site ``site`` (itself included), or ``None``.

    Example:
        >>> m = nn.Sequential(nn.Sequential(nn.Linear(1, 1)))
        >>> block_of(m, "0.0", ["Sequential"]), block_of(m, "0.0", [])
        ('', None)
    """
    parts = site.split(".") if site else []
    for depth in range(len(parts) + 1):
        name = ".".join(parts[:depth])
        if type(model.get_submodule(name)).__name__ in no_split:
            return name
    return None


def no_split_classes(model: nn.Module, given: Sequence[str] | None = None) -> list[str]:
    """The classes kept whole: those given, and a transformers model's ``_no_split_modules``.

    Example:
        >>> no_split_classes(nn.Linear(1, 1), ["Block"])
        ['Block']
    """
    declared = getattr(model, "_no_split_modules", None)
    return [*(given or ()), *(declared if isinstance(declared, (list, tuple, set)) else ())]


def stream_model(model: nn.Module, device: torch.device, slots: int = OFFLOAD_SLOTS,
                 cap: int | None = None, no_split_module_classes: Sequence[str] | None = None
                 ) -> list[Any]:
    """Stream the offload hooks of a dispatched ``model`` on ``device``, one group per block.

    ``dispatch_model`` does this itself on a GPU; this is for running the same pipeline on the
    CPU (synchronous copies: the tests and ``scripts/check_gpu_loading.py --cpu``).

    Returns:
        The hooks left to load their weights the plain way.

    Example:
        >>> from nbaccel.big_modeling import cpu_offload
        >>> model = cpu_offload(nn.Sequential(nn.Linear(2, 2)), "cpu")
        >>> stream_model(model, torch.device("cpu"))
        []
    """
    no_split = no_split_classes(model, no_split_module_classes)
    hooks, blocks = [], []
    for name, module in model.named_modules():
        hook = getattr(module, "_hf_hook", None)
        parts: Sequence[Any] = getattr(hook, "hooks", (hook,))  # a SequentialHook's parts too (hooks are duck-typed)
        for part in parts:
            if getattr(part, "offload", False) and getattr(part, "weights_map", None) is not None:
                names = part._names(module)
                if names:
                    hooks.append((part, names))
                    blocks.append(block_of(model, name, no_split))
    return stream_offloaded(hooks, device, slots=slots, cap=cap, blocks=blocks)
