"""Moving a module's named tensors, and nested inputs, between devices.

These are the small operations every hook and loader is built from: put one parameter or
buffer of a module on a device (optionally with new values), list a module's tensors, send a
nested structure of tensors somewhere, and find where a nested structure lives.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from nbaccel.errors import CheckpointError, CheckpointMismatchError, DeviceMapError

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

__all__ = [
    "Device",
    "clear_device_cache",
    "find_device",
    "named_module_tensors",
    "set_module_tensor_to_device",
]

# What a device map value may be: a GPU index, a name such as "cpu", "cuda:1", "disk", "meta".
Device = int | str | torch.device


def _owner(module: nn.Module, tensor_name: str) -> tuple[nn.Module, str]:
    """The submodule that holds ``tensor_name`` and the tensor's own short name."""
    *path, leaf = tensor_name.split(".")
    owner = module
    for part in path:
        child = getattr(owner, part, None)
        if not isinstance(child, nn.Module):
            raise DeviceMapError(
                f"{tensor_name!r} does not name a tensor of {type(module).__name__}: it has no "
                f"submodule {part!r}. List valid names with `dict(model.named_parameters())`.",
                key=tensor_name, value=None, valid="names from model.state_dict()")
        owner = child
    if leaf not in owner._parameters and leaf not in owner._buffers:
        raise DeviceMapError(
            f"{tensor_name!r} does not name a tensor of {type(module).__name__}: "
            f"{type(owner).__name__} has no parameter or buffer {leaf!r}. List valid names with "
            "`model.state_dict().keys()`.",
            key=tensor_name, value=None, valid="names from model.state_dict()")
    return owner, leaf


def set_module_tensor_to_device(module: nn.Module, tensor_name: str, device: Device,
                                value: torch.Tensor | None = None,
                                dtype: torch.dtype | str | None = None) -> None:
    """Put one parameter or buffer of ``module`` on ``device``, optionally with new values.

    A parameter stays a parameter of the same class with the same ``requires_grad``. ``value``
    already on ``device`` is used as it is, without a copy. Moving to ``"meta"`` frees the data.

    Args:
        module: the module holding the tensor (directly or in a submodule).
        tensor_name: dotted name as in ``module.state_dict()``, e.g. ``"blocks.0.fc.weight"``.
        device: where to put it (``0``, ``"cuda:1"``, ``"cpu"``, ``"meta"``).
        value: new values of the same shape; ``None`` moves the current values.
        dtype: cast floating-point values to this dtype on the way.

    Raises:
        DeviceMapError: ``tensor_name`` is not a tensor of ``module``.
        CheckpointMismatchError: ``value`` has a different shape from the tensor.
        CheckpointError: the tensor is on the meta device and no ``value`` is given (a
            ``ValueError``, as Accelerate raises).

    Example:
        >>> lin = torch.nn.Linear(2, 2, device="meta")
        >>> set_module_tensor_to_device(lin, "weight", "cpu", value=torch.ones(2, 2))
        >>> lin.weight.device.type, lin.weight.requires_grad
        ('cpu', True)
    """
    owner, leaf = _owner(module, tensor_name)
    is_param = leaf in owner._parameters
    old = owner._parameters[leaf] if is_param else owner._buffers[leaf]
    if old is None:
        return
    device = as_torch_device(device)
    if value is not None and tuple(value.shape) != tuple(old.shape):
        raise CheckpointMismatchError(
            f'Trying to set a tensor of shape {value.shape} in "{leaf}" (which has shape {old.shape}), this looks '
            f"incorrect. Fix: check that the checkpoint holding {tensor_name!r} was saved from this model's "
            "configuration.",  # Accelerate's words first: its tests check them
            mismatched_shapes={tensor_name: (tuple(value.shape), tuple(old.shape))})
    if value is None and old.device.type == "meta" and device.type != "meta":
        raise CheckpointError(
            f"{tensor_name!r} is on the meta device (it holds no values), so it cannot be moved to {device}. "
            f"Fix: pass its values, e.g. set_module_tensor_to_device(module, {tensor_name!r}, {str(device)!r}, "
            "value=state_dict[...]).")
    cast_to = as_torch_dtype(dtype)
    new = old if value is None else value
    target: torch.dtype | None = None
    if cast_to is not None and new.is_floating_point():
        target = cast_to
    elif value is not None and new.is_floating_point() and old.is_floating_point():
        target = old.dtype  # as load_state_dict does: values take the model's dtype
    new = new.to(device) if target in (None, new.dtype) else new.to(device=device, dtype=target)
    if is_param:
        if type(new) is not type(old):
            # `old` is a value of `owner._parameters`, so its class is nn.Parameter or a subclass of it
            param_class = cast("type[nn.Parameter]", type(old))
            new = param_class(new.detach(), requires_grad=old.requires_grad)
        owner._parameters[leaf] = cast(nn.Parameter, new)  # of old's class: unchanged, or rebuilt just above
    else:
        owner._buffers[leaf] = new


def as_torch_device(device: Device) -> torch.device:
    """A device-map entry as a ``torch.device`` (an int is a CUDA index, as in Accelerate's maps)."""
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device)


def as_torch_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A dtype argument as a ``torch.dtype``: ``"float16"`` and ``"torch.float16"`` name ``torch.float16``.

    Example:
        >>> as_torch_dtype("torch.bfloat16")
        torch.bfloat16
    """
    if isinstance(dtype, str):
        return getattr(torch, dtype.removeprefix("torch."))
    return dtype


def cpu_memoryview(tensor: torch.Tensor) -> memoryview:
    """The memory of a CPU tensor as a ``memoryview`` (no copy), in its numpy format.

    Example:
        >>> cpu_memoryview(torch.ones(2, dtype=torch.uint8)).tolist()
        [1, 1]
    """
    # an ndarray implements the buffer protocol; numpy's stubs declare `__buffer__` only for Python >= 3.12
    return memoryview(cast("ReadableBuffer", tensor.numpy()))


def set_module_attribute(module: nn.Module, name: str, value: object) -> None:
    """``setattr(module, name, value)`` for a value that is no tensor or module (a hook, a device map).

    nn.Module's ``__setattr__`` is typed for tensors and modules only; at run time it stores any value.

    Example:
        >>> lin = torch.nn.Linear(1, 1); set_module_attribute(lin, "hf_device_map", {"": "cpu"})
        >>> lin.hf_device_map
        {'': 'cpu'}
    """
    setattr(module, name, value)


def named_module_tensors(module: nn.Module, include_buffers: bool = True, recurse: bool = False,
                         remove_non_persistent: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """A module's parameters (and buffers), by every name they have (tied ones under each).

    Args:
        module: the module.
        include_buffers: also list buffers.
        recurse: also list the tensors of submodules.
        remove_non_persistent: leave out buffers registered with ``persistent=False`` (those a
            state dict does not hold).

    Returns:
        An iterator of ``(name, tensor)``.

    Example:
        >>> [n for n, _ in named_module_tensors(torch.nn.BatchNorm1d(2))]
        ['weight', 'bias', 'running_mean', 'running_var', 'num_batches_tracked']
    """
    yield from module.named_parameters(recurse=recurse, remove_duplicate=False)
    if include_buffers:
        skip: set[str] = set()
        if remove_non_persistent:
            modules = module.named_modules() if recurse else [("", module)]
            skip = {f"{prefix}.{b}" if prefix else b
                    for prefix, sub in modules for b in sub._non_persistent_buffers_set}
        yield from ((n, b) for n, b in module.named_buffers(recurse=recurse, remove_duplicate=False) if n not in skip)


def find_device(data: Any) -> torch.device | None:
    """The device of the first tensor found in a nested structure, or ``None``.

    Example:
        >>> find_device([1, {"a": torch.ones(1)}])
        device(type='cpu')
    """
    if isinstance(data, torch.Tensor):
        return data.device
    values = data.values() if isinstance(data, Mapping) else \
        data if isinstance(data, (list, tuple)) else ()
    for v in values:
        found = find_device(v)
        if found is not None:
            return found
    return None


def key_list(skip_keys: Sequence[str] | str | None) -> list[str] | str | None:
    """``skip_keys`` as :func:`~nbaccel.nested_data.send_to_device` takes them: a sequence as a list.

    Example:
        >>> key_list(("mask",)), key_list("mask")
        (['mask'], 'mask')
    """
    return skip_keys if skip_keys is None or isinstance(skip_keys, str) else list(skip_keys)


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Release cached accelerator memory (CUDA's caching allocator), if CUDA is in use.

    Example:
        >>> clear_device_cache()
    """
    if garbage_collection:
        gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
