"""Accelerate's ``accelerate.hooks`` import path: re-exports only, so ``from accelerate.hooks import X`` ports as is.

Nothing is defined here; the hooks live in :mod:`nbaccel.big_modeling.hooks` (the protocol and the
device/offload hooks), :mod:`nbaccel.big_modeling.hook_attach` (attaching them to a module tree)
and :mod:`nbaccel.big_modeling.layerwise_casting`.
"""

from __future__ import annotations

from nbaccel.big_modeling.hooks import (
    AlignDevicesHook,
    CpuOffload,
    ModelHook,
    SequentialHook,
    UserCpuOffloadHook,
    add_hook_to_module,
    remove_hook_from_module,
)

__all__ = [
    "AlignDevicesHook",
    "CpuOffload",
    "ModelHook",
    "SequentialHook",
    "UserCpuOffloadHook",
    "add_hook_to_module",
    "remove_hook_from_module",
]
