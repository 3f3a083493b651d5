"""Accelerate's ``accelerate.hooks`` import path: re-exports only, so ``from accelerate.hooks import X`` ports as is.

Nothing is defined here; the hooks live in :mod:`nbaccel.big_modeling.hooks` (the protocol and the
device/offload hooks), :mod:`nbaccel.big_modeling.cpu_offload_hook` (a whole model on CPU),
:mod:`nbaccel.big_modeling.hook_attach` (attaching them to a module tree)
and :mod:`nbaccel.big_modeling.layerwise_casting`.
"""

from __future__ import annotations

from nbaccel.big_modeling.hook_attach import (
    attach_align_device_hook,
    attach_align_device_hook_on_blocks,
    attach_execution_device_hook,
    remove_hook_from_submodules,
)
from nbaccel.big_modeling.cpu_offload_hook import CpuOffload, UserCpuOffloadHook
from nbaccel.big_modeling.hooks import (
    AlignDevicesHook,
    ModelHook,
    SequentialHook,
    add_hook_to_module,
    remove_hook_from_module,
)
from nbaccel.big_modeling.layerwise_casting import (
    LayerwiseCastingHook,
    attach_layerwise_casting_hooks,
)
from nbaccel.device_backend import normalize_device

__all__ = [
    "AlignDevicesHook",
    "CpuOffload",
    "LayerwiseCastingHook",
    "ModelHook",
    "SequentialHook",
    "UserCpuOffloadHook",
    "add_hook_to_module",
    "attach_align_device_hook",
    "attach_align_device_hook_on_blocks",
    "attach_execution_device_hook",
    "attach_layerwise_casting_hooks",
    "normalize_device",
    "remove_hook_from_module",
    "remove_hook_from_submodules",
]
