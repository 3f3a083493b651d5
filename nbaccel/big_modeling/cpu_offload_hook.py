"""A whole model kept on CPU and moved to its execution device when called: Accelerate's ``CpuOffload`` hook.

:func:`~nbaccel.big_modeling.dispatch.cpu_offload_with_hook` attaches it and returns the
:class:`UserCpuOffloadHook` handle, so models of a pipeline take turns on one GPU.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nbaccel.big_modeling.hooks import ModelHook, remove_hook_from_module
from nbaccel.big_modeling.tensors import Device, clear_device_cache
from nbaccel.nested_data import send_to_device

__all__ = ["CpuOffload", "UserCpuOffloadHook", "default_execution_device"]


class CpuOffload(ModelHook):
    """Keep a whole model on CPU, and move it to ``execution_device`` when it is called.

    Calling it first sends the previous model of a pipeline back to CPU (``prev_module_hook``).

    Args:
        execution_device: where the forward runs; the first GPU when ``None``, else CPU.
        prev_module_hook: the :class:`UserCpuOffloadHook` of the model that runs before this one.

    Example:
        >>> from nbaccel.big_modeling.hooks import add_hook_to_module
        >>> m = add_hook_to_module(torch.nn.Linear(2, 2), CpuOffload("cpu"))
        >>> m(torch.ones(1, 2)).shape
        torch.Size([1, 2])
    """

    def __init__(self, execution_device: Device | None = None,
                 prev_module_hook: UserCpuOffloadHook | None = None) -> None:
        self.prev_module_hook = prev_module_hook
        self.execution_device = execution_device if execution_device is not None \
            else default_execution_device()

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module.to("cpu")

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        if self.prev_module_hook is not None:
            self.prev_module_hook.offload()
            clear_device_cache()
        module.to(self.execution_device)
        return (send_to_device(args, self.execution_device),
                send_to_device(kwargs, self.execution_device))


class UserCpuOffloadHook:
    """The handle :func:`~nbaccel.big_modeling.dispatch.cpu_offload_with_hook` returns.

    Args:
        model: the model the hook is attached to.
        hook: its :class:`CpuOffload` hook.

    Example:
        >>> from nbaccel.big_modeling.dispatch import cpu_offload_with_hook
        >>> model, hook = cpu_offload_with_hook(torch.nn.Linear(2, 2), "cpu")
        >>> hook.offload(); hook.remove()
    """

    def __init__(self, model: nn.Module, hook: CpuOffload) -> None:
        self.model = model
        self.hook = hook

    def offload(self) -> None:
        """Send the model back to CPU."""
        self.hook.init_hook(self.model)

    def remove(self) -> None:
        """Remove the hook from the model."""
        remove_hook_from_module(self.model)


def default_execution_device() -> torch.device:
    """Where offloaded weights run when no device is named: the first GPU, else the CPU."""
    from nbaccel.hardware import cuda_device_count

    return torch.device("cuda", 0) if cuda_device_count() > 0 else torch.device("cpu")
