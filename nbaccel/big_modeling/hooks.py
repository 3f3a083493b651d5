"""Hooks around a module's forward: the protocol, chaining, and the device and offload hook of a dispatch.

A hook is a small object with four methods (``init_hook``, ``pre_forward``, ``post_forward``,
``detach_hook``). :func:`add_hook_to_module` wraps ``module.forward`` so that the hook runs
around it; :func:`remove_hook_from_module` restores the original forward. Moving weights to
the execution device and offloading them afterwards are just hooks. The attribute names
(``_hf_hook``, ``_old_forward``) are Accelerate's, so libraries that look for them work. One
addition to Accelerate's protocol: when the wrapped forward raises, a hook's optional
``forward_failed(module)`` runs (``post_forward`` does not), so offloaded weights and device
slots loaded for that call are given back instead of staying loaded after the error. The hook that
keeps a whole model on CPU (``cpu_offload_with_hook``) is in :mod:`nbaccel.big_modeling.cpu_offload_hook`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

from nbaccel.big_modeling.tensors import (
    Device,
    find_device,
    named_module_tensors,
    key_list,
    set_module_attribute,
    set_module_tensor_to_device,
)
from nbaccel.errors import ConfigError
from nbaccel.nested_data import send_to_device

__all__ = [
    "AlignDevicesHook",
    "ModelHook",
    "SequentialHook",
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
        old_hook = _hook_of(module)
        remove_hook_from_module(module)
        hook = SequentialHook(old_hook, hook)
    if hasattr(module, "_hf_hook") and hasattr(module, "_old_forward"):
        old_forward = _old_forward_of(module)  # replacing a hook: wrap the original forward
    else:
        old_forward = module.forward
        set_module_attribute(module, "_old_forward", old_forward)
    module = hook.init_hook(module)
    set_module_attribute(module, "_hf_hook", hook)

    def new_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = _hook_of(module).pre_forward(module, *args, **kwargs)
        try:
            if _hook_of(module).no_grad:
                with torch.no_grad():
                    output = _old_forward_of(module)(*args, **kwargs)
            else:
                output = _old_forward_of(module)(*args, **kwargs)
        except BaseException:
            # nbaccel's addition to the protocol: a hook that loaded something for this call
            # (offloaded weights, a device slot) gives it back when the forward raises
            failed = getattr(_hook_of(module), "forward_failed", None)
            if failed is not None:
                failed(module)
            raise
        return _hook_of(module).post_forward(module, output)

    wrapped = functools.update_wrapper(functools.partial(new_forward, module), old_forward)
    if "GraphModuleImpl" in str(type(module)):  # fx modules look forward up on the class
        module.__class__.forward = wrapped
    else:
        module.forward = wrapped
    return module


def _hook_of(module: nn.Module) -> ModelHook:
    return cast(ModelHook, module._hf_hook)  # set by add_hook_to_module; nn.Module types unknown attributes as tensors


def _old_forward_of(module: nn.Module) -> Callable[..., Any]:
    return cast("Callable[..., Any]", module._old_forward)  # the forward add_hook_to_module wrapped, as above


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
        _hook_of(module).detach_hook(module)
        delattr(module, "_hf_hook")
    if hasattr(module, "_old_forward"):
        if "GraphModuleImpl" in str(type(module)):
            module.__class__.forward = _old_forward_of(module)
        else:
            module.forward = _old_forward_of(module)
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
                    device, weights = self._load_from(values)
                    set_module_tensor_to_device(module, name, device, value=weights[name])
            except BaseException:
                self.forward_failed(module)
                raise
            if self.prefetch is not None and values is None:  # a streamed group is prefetched by its ring
                self.prefetch()
        if self.execution_device is None:
            return args, kwargs
        return (send_to_device(args, self.execution_device),
                send_to_device(kwargs, self.execution_device, skip_keys=key_list(self.skip_keys)))

    def _load_from(self, values: Mapping[str, torch.Tensor] | None) -> tuple[Device, Mapping[str, torch.Tensor]]:
        """Where offloaded weights go for this call, and what they are read from (the streamed slot's ``values``)."""
        weights = self.weights_map if values is None else values
        if self.execution_device is None or weights is None:  # weights_map: only a "meta" device keeps none
            missing = "execution_device" if self.execution_device is None else "weights_map"
            raise ConfigError(f"{self!r} cannot load its offloaded weights: it has no {missing}. Fix: pass "
                              "execution_device (e.g. 0 or 'cpu') and weights_map.", key=missing, value=None)
        return self.execution_device, weights

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        if self.offload:
            self._unload(module)
        if self.io_same_device and self.input_device is not None:
            output = send_to_device(output, self.input_device, skip_keys=key_list(self.skip_keys))
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
                    assert self.weights_map is not None, "init_hook set original_devices and weights_map together"
                    set_module_tensor_to_device(module, name, device,
                                                value=self.weights_map.get(name))
        return module
