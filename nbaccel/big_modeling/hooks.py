"""Hooks around a module's forward: the protocol, chaining, and the device and offload hooks.

A hook is a small object with four methods (``init_hook``, ``pre_forward``, ``post_forward``,
``detach_hook``). :func:`add_hook_to_module` wraps ``module.forward`` so that the hook runs
around it; :func:`remove_hook_from_module` restores the original forward. Moving weights to
the execution device and offloading them afterwards are just hooks. The attribute names
(``_hf_hook``, ``_old_forward``) are Accelerate's, so libraries that look for them work. One
addition to Accelerate's protocol: when the wrapped forward raises, a hook's optional
``forward_failed(module)`` runs (``post_forward`` does not), so offloaded weights and device
slots loaded for that call are given back instead of staying loaded after the error.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from nbaccel.big_modeling.tensors import (
    Device,
    clear_device_cache,
    find_device,
    named_module_tensors,
    set_module_tensor_to_device,
)
from nbaccel.nested_data import send_to_device

__all__ = [
    "AlignDevicesHook",
    "CpuOffload",
    "ModelHook",
    "SequentialHook",
    "UserCpuOffloadHook",
    "add_hook_to_module",
    "remove_hook_from_module",
]


class ModelHook:
    """The hook protocol: override any of the four methods.

    Attributes:
        no_grad: run the wrapped forward under ``torch.no_grad()``.

    Example:
        >>> class Double(ModelHook):
        ...     def post_forward(self, module, output):
        ...         return output * 2
        >>> lin = add_hook_to_module(torch.nn.Identity(), Double())
        >>> lin(torch.ones(1)).item()
        2.0
    """

    no_grad: bool = False

    def init_hook(self, module: nn.Module) -> nn.Module:
        """Called once when the hook is attached; returns the module."""
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        """Called before the forward; returns the (possibly changed) ``args`` and ``kwargs``."""
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        """Called after the forward; returns the (possibly changed) output."""
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        """Called when the hook is removed; returns the module."""
        return module


class SequentialHook(ModelHook):
    """Several hooks run in order (``post_forward`` in the same order, as Accelerate does).

    Example:
        >>> hook = SequentialHook(ModelHook(), ModelHook())
        >>> len(hook.hooks)
        2
    """

    def __init__(self, *hooks: ModelHook) -> None:
        self.hooks = hooks

    def init_hook(self, module: nn.Module) -> nn.Module:
        for hook in self.hooks:
            module = hook.init_hook(module)
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        for hook in self.hooks:
            args, kwargs = hook.pre_forward(module, *args, **kwargs)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        for hook in self.hooks:
            output = hook.post_forward(module, output)
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        for hook in self.hooks:
            module = hook.detach_hook(module)
        return module

    def forward_failed(self, module: nn.Module) -> None:
        """The wrapped forward raised: each hook that can gives back what it loaded."""
        for hook in self.hooks:
            failed = getattr(hook, "forward_failed", None)
            if failed is not None:
                failed(module)


def add_hook_to_module(module: nn.Module, hook: ModelHook, append: bool = False) -> nn.Module:
    """Run ``hook`` around every call of ``module``'s forward.

    Args:
        module: the module to wrap.
        hook: the hook; its ``init_hook`` runs now.
        append: chain after a hook already there (as a :class:`SequentialHook`) instead of
            replacing it.

    Returns:
        The module (as returned by ``hook.init_hook``).

    Example:
        >>> m = add_hook_to_module(torch.nn.Identity(), ModelHook())
        >>> hasattr(m, "_hf_hook")
        True
    """
    if append and getattr(module, "_hf_hook", None) is not None:
        old_hook = module._hf_hook
        remove_hook_from_module(module)
        hook = SequentialHook(old_hook, hook)
    if hasattr(module, "_hf_hook") and hasattr(module, "_old_forward"):
        old_forward = module._old_forward  # replacing a hook: wrap the original forward
    else:
        old_forward = module.forward
        module._old_forward = old_forward
    module = hook.init_hook(module)
    module._hf_hook = hook

    def new_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = module._hf_hook.pre_forward(module, *args, **kwargs)
        try:
            if module._hf_hook.no_grad:
                with torch.no_grad():
                    output = module._old_forward(*args, **kwargs)
            else:
                output = module._old_forward(*args, **kwargs)
        except BaseException:
            # nbaccel's addition to the protocol: a hook that loaded something for this call
            # (offloaded weights, a device slot) gives it back when the forward raises
            failed = getattr(module._hf_hook, "forward_failed", None)
            if failed is not None:
                failed(module)
            raise
        return module._hf_hook.post_forward(module, output)

    wrapped = functools.update_wrapper(functools.partial(new_forward, module), old_forward)
    if "GraphModuleImpl" in str(type(module)):  # fx modules look forward up on the class
        module.__class__.forward = wrapped
    else:
        module.forward = wrapped
    return module


def remove_hook_from_module(module: nn.Module, recurse: bool = False) -> nn.Module:
    """Remove the hook of ``module`` (and of its submodules with ``recurse``).

    The hook's ``detach_hook`` runs, so offloaded weights come back where they were.

    Args:
        module: the module.
        recurse: also remove the hooks of every submodule.

    Returns:
        The module.

    Example:
        >>> m = remove_hook_from_module(add_hook_to_module(torch.nn.Identity(), ModelHook()))
        >>> hasattr(m, "_hf_hook")
        False
    """
    if hasattr(module, "_hf_hook"):
        module._hf_hook.detach_hook(module)
        delattr(module, "_hf_hook")
    if hasattr(module, "_old_forward"):
        if "GraphModuleImpl" in str(type(module)):
            module.__class__.forward = module._old_forward
        else:
            module.forward = module._old_forward
        delattr(module, "_old_forward")
    if recurse:
        for child in module.children():
            remove_hook_from_module(child, recurse)
    return module


class AlignDevicesHook(ModelHook):
    """Run a module on ``execution_device``; with ``offload``, load its weights only for the call.

    Without offload the module's tensors are moved to the execution device once, when the hook
    is attached. With offload they are set to the meta device at attach time and read from
    ``weights_map`` before each forward, then released after it. Inputs are sent to the
    execution device; with ``io_same_device`` outputs go back to the inputs' device.

    Args:
        execution_device: where the forward runs.
        offload: keep the weights off the module between calls.
        io_same_device: return outputs on the device the inputs came from.
        weights_map: name -> tensor, for the offloaded weights (names relative to the module).
            ``None`` takes them from the module itself (moved to CPU) at attach time.
        offload_buffers: offload buffers too (otherwise they live on the execution device).
        place_submodules: handle the tensors of submodules too (a whole block).
        skip_keys: keyword arguments left where they are.
        prefetch: a callable run after this module's weights are loaded, to start fetching
            the next offloaded module's weights while this one computes.

    Attributes:
        streamed: set by :func:`~.streamed_offload.stream_offloaded`: gives the offloaded weights
            already on the execution device (copied ahead of time), or ``None`` when they must be
            loaded the plain way.

    Example:
        >>> lin = torch.nn.Linear(2, 2)
        >>> x = torch.ones(1, 2); ref = lin(x)
        >>> _ = add_hook_to_module(lin, AlignDevicesHook("cpu", offload=True))
        >>> lin.weight.device.type, torch.equal(lin(x), ref)
        ('meta', True)
    """

    def __init__(self, execution_device: Device | None = None, offload: bool = False,
                 io_same_device: bool = False,
                 weights_map: Mapping[str, torch.Tensor] | None = None,
                 offload_buffers: bool = False, place_submodules: bool = False,
                 skip_keys: Sequence[str] | str | None = None,
                 prefetch: Any = None) -> None:
        self.execution_device = execution_device
        self.offload = offload
        self.io_same_device = io_same_device
        self.weights_map = weights_map
        self.offload_buffers = offload_buffers
        self.place_submodules = place_submodules
        self.skip_keys = skip_keys
        self.prefetch = prefetch
        self.streamed: Any = None
        self._streaming: list[bool] = []  # per (possibly nested) call: weights came from a slot
        self.input_device: torch.device | None = None
        self.original_devices: dict[str, torch.device] = {}

    def __repr__(self) -> str:
        return (f"AlignDevicesHook(execution_device={self.execution_device!r}, "
                f"offload={self.offload}, io_same_device={self.io_same_device}, "
                f"offload_buffers={self.offload_buffers}, "
                f"place_submodules={self.place_submodules})")

    def _names(self, module: nn.Module) -> list[str]:
        return [name for name, _ in named_module_tensors(
            module, include_buffers=self.offload_buffers, recurse=self.place_submodules)]

    def init_hook(self, module: nn.Module) -> nn.Module:
        if self.execution_device == "meta" or str(self.execution_device) == "meta":
            for name, _ in named_module_tensors(module, recurse=self.place_submodules):
                set_module_tensor_to_device(module, name, "meta")
            return module
        if not self.offload and self.execution_device is not None:
            for name, _ in named_module_tensors(module, recurse=self.place_submodules):
                set_module_tensor_to_device(module, name, self.execution_device)
            return module
        if not self.offload:
            return module
        tensors = dict(named_module_tensors(module, include_buffers=self.offload_buffers,
                                            recurse=self.place_submodules))
        self.original_devices = {name: t.device for name, t in tensors.items()}
        if self.weights_map is None:
            self.weights_map = {name: t.to("cpu") for name, t in tensors.items()}
        for name in tensors:
            set_module_tensor_to_device(module, name, "meta")
        if not self.offload_buffers and self.execution_device is not None:
            for name, _ in module.named_buffers(recurse=self.place_submodules):
                set_module_tensor_to_device(module, name, self.execution_device)
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        if self.io_same_device:
            self.input_device = find_device([args, kwargs])
        if self.offload:
            values = self.streamed.acquire() if self.streamed is not None else None
            self._streaming.append(values is not None)
            try:
                for name in self._names(module):
                    set_module_tensor_to_device(module, name, self.execution_device,
                                                value=(self.weights_map if values is None else values)[name])
            except BaseException:
                self.forward_failed(module)
                raise
            if self.prefetch is not None and values is None:  # a streamed group is prefetched by its ring
                self.prefetch()
        if self.execution_device is None:
            return args, kwargs
        return (send_to_device(args, self.execution_device),
                send_to_device(kwargs, self.execution_device, skip_keys=self.skip_keys))

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        if self.offload:
            self._unload(module)
        if self.io_same_device and self.input_device is not None:
            output = send_to_device(output, self.input_device, skip_keys=self.skip_keys)
        return output

    def _unload(self, module: nn.Module) -> None:
        for name in self._names(module):
            set_module_tensor_to_device(module, name, "meta")
        if self._streaming and self._streaming.pop():
            self.streamed.release()

    def forward_failed(self, module: nn.Module) -> None:
        """The forward raised: release the offloaded weights (and their slot) as after a call."""
        if self.offload:
            self._unload(module)

    def detach_hook(self, module: nn.Module) -> nn.Module:
        if self.offload:
            for name, device in self.original_devices.items():
                if device.type != "meta":
                    set_module_tensor_to_device(module, name, device,
                                                value=self.weights_map.get(name))
        return module


class CpuOffload(ModelHook):
    """Keep a whole model on CPU, and move it to ``execution_device`` when it is called.

    Calling it first sends the previous model of a pipeline back to CPU (``prev_module_hook``).

    Args:
        execution_device: where the forward runs; the first GPU when ``None``, else CPU.
        prev_module_hook: the :class:`UserCpuOffloadHook` of the model that runs before this one.

    Example:
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
