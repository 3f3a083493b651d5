"""Building a model without allocating its weights: on the meta device, or straight on a device.

Inside :func:`init_empty_weights` every parameter a module registers is put on the meta device
as soon as it is registered, so building a model of any size takes moments and no memory; its
initialization code runs on meta tensors, which costs nothing. Buffers stay real by default,
so values computed at construction (position tables, masks) survive.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from nbaccel.big_modeling.tensors import Device, as_torch_device

__all__ = ["init_empty_weights", "init_on_device"]

# register_parameter is patched on the class, so two threads entering at once would unpatch
# each other's patch; one lock keeps the patch and its undo paired.
_PATCH_LOCK = threading.RLock()


@contextmanager
def init_empty_weights(include_buffers: bool = False) -> Iterator[None]:
    """Build models on the meta device: shapes and dtypes, no data.

    Args:
        include_buffers: put buffers on the meta device too. Non-persistent buffers (which no
            checkpoint holds) then lose their values, so leave this off unless every buffer is
            in the checkpoint.

    Example:
        >>> with init_empty_weights():
        ...     model = torch.nn.Linear(20_000, 20_000)  # 1.6 GB in fp32, built in moments
        >>> model.weight.device.type
        'meta'
    """
    with init_on_device(torch.device("meta"), include_buffers=include_buffers):
        yield


@contextmanager
def init_on_device(device: Device, include_buffers: bool = False) -> Iterator[None]:
    """Build models with their parameters (and, optionally, buffers) on ``device``.

    Args:
        device: where parameters go (``"meta"``, ``"cpu"``, ``0``, ``"cuda:1"``).
        include_buffers: also create buffers there (every tensor made inside goes to
            ``device``, through torch's device context).

    Example:
        >>> with init_on_device("meta"):
        ...     lin = torch.nn.Linear(4, 4)
        >>> lin.weight.is_meta
        True
    """
    device = as_torch_device(device)
    if include_buffers:
        with device:
            yield
        return
    with _PATCH_LOCK:
        original = nn.Module.register_parameter

        def register_parameter_on_device(module: nn.Module, name: str,
                                         param: nn.Parameter | None) -> None:
            original(module, name, param)
            if param is not None and param.device != device:
                registered = module._parameters[name]
                assert registered is not None, "register_parameter just stored the parameter under this name"
                extra = dict(registered.__dict__)
                extra["requires_grad"] = registered.requires_grad
                module._parameters[name] = type(registered)(registered.to(device), **extra)

        # setattr: patching the class's method is the point (mypy rejects assigning to a method)
        setattr(nn.Module, "register_parameter", register_parameter_on_device)  # noqa: B010 - see above
        try:
            yield
        finally:
            setattr(nn.Module, "register_parameter", original)  # noqa: B010 - as above
