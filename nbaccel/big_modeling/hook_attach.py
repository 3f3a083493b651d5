"""Attaching and removing hooks over a whole module tree, as Accelerate's ``accelerate.hooks`` functions do.

:func:`attach_align_device_hook` gives every module that holds tensors directly its own
:class:`~nbaccel.big_modeling.hooks.AlignDevicesHook` (offloaded weights looked up under the
module's dotted name); :func:`attach_execution_device_hook` only moves inputs and tensors to one
device; :func:`attach_align_device_hook_on_blocks` does either per block of a device map;
:func:`remove_hook_from_submodules` takes every hook off again.

Differs from Accelerate: there is no ``tied_params_map`` argument (nbaccel's loading makes tied
names share one tensor; it keeps no map of per-device copies).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from nbaccel.big_modeling.hooks import (
    AlignDevicesHook,
    add_hook_to_module,
    remove_hook_from_module,
)
from nbaccel.big_modeling.offload import PrefixedDataset
from nbaccel.big_modeling.tensors import named_module_tensors

__all__ = ["attach_align_device_hook", "attach_align_device_hook_on_blocks", "attach_execution_device_hook",
           "remove_hook_from_submodules"]

Device = int | str | torch.device


def remove_hook_from_submodules(module: nn.Module) -> None:
    """Remove the hooks of ``module`` and of every submodule (each hook's ``detach_hook`` runs).

    Example:
        >>> m = nn.Sequential(nn.Linear(1, 1)); attach_execution_device_hook(m, "cpu")
        >>> remove_hook_from_submodules(m); hasattr(m[0], "_hf_hook")
        False
    """
    remove_hook_from_module(module)
    for child in module.children():
        remove_hook_from_submodules(child)


def attach_execution_device_hook(module: nn.Module, execution_device: Device | None,
                                 skip_keys: str | Sequence[str] | None = None,
                                 preload_module_classes: Sequence[str] | None = None) -> None:
    """Give every module with a state (and no hook yet) a hook that runs it on ``execution_device``.

    Args:
        module: the root of the tree.
        execution_device: where the forwards run (``None``: where the tensors are, nothing is moved).
        skip_keys: keyword arguments not moved.
        preload_module_classes: class names whose submodules get no hook of their own.

    Example:
        >>> m = nn.Sequential(nn.Linear(1, 1)); attach_execution_device_hook(m, "cpu")
        >>> type(m[0]._hf_hook).__name__
        'AlignDevicesHook'
    """
    if not hasattr(module, "_hf_hook") and len(module.state_dict()) > 0:
        add_hook_to_module(module, AlignDevicesHook(execution_device, skip_keys=skip_keys))
    if preload_module_classes is not None and type(module).__name__ in preload_module_classes:
        return
    for child in module.children():
        attach_execution_device_hook(child, execution_device, skip_keys=skip_keys,
                                     preload_module_classes=preload_module_classes)


def attach_align_device_hook(module: nn.Module, execution_device: Device | None = None, offload: bool = False,
                             weights_map: Mapping[str, torch.Tensor] | None = None, offload_buffers: bool = False,
                             module_name: str = "", skip_keys: str | Sequence[str] | None = None,
                             preload_module_classes: Sequence[str] | None = None) -> None:
    """Add an :class:`AlignDevicesHook` to every module in the tree that holds tensors directly.

    With ``offload``, each hooked module's weights are read from ``weights_map`` (keys are full
    dotted names from the root, ``module_name`` being this module's) only for its forward. A
    module whose class is in ``preload_module_classes`` is handled whole, with its submodules.

    Args:
        module: the root of the tree.
        execution_device: where the forwards run.
        offload: keep weights off the modules between forwards.
        weights_map: full name -> tensor, for offloaded weights (``None``: taken from the modules).
        offload_buffers: offload buffers too.
        module_name: ``module``'s dotted name within the model ``weights_map`` describes.
        skip_keys: keyword arguments not moved.
        preload_module_classes: class names loaded whole before their forward.

    Example:
        >>> m = nn.Sequential(nn.Linear(2, 2)); x = torch.ones(1, 2); ref = m(x)
        >>> attach_align_device_hook(m, "cpu", offload=True, weights_map=m.state_dict())
        >>> m[0].weight.device.type, torch.equal(m(x), ref)
        ('meta', True)
    """
    full_offload = offload and preload_module_classes is not None and type(module).__name__ in preload_module_classes
    if list(named_module_tensors(module)) or full_offload:
        prefixed = None
        if weights_map is not None:
            prefixed = PrefixedDataset(weights_map, f"{module_name}." if module_name else "")
        hook = AlignDevicesHook(execution_device=execution_device, offload=offload, weights_map=prefixed,
                                offload_buffers=offload_buffers, place_submodules=full_offload, skip_keys=skip_keys)
        add_hook_to_module(module, hook, append=True)
    if full_offload:
        return
    for child_name, child in module.named_children():
        attach_align_device_hook(child, execution_device=execution_device, offload=offload, weights_map=weights_map,
                                 offload_buffers=offload_buffers,
                                 module_name=f"{module_name}.{child_name}" if module_name else child_name,
                                 skip_keys=skip_keys, preload_module_classes=preload_module_classes)


def attach_align_device_hook_on_blocks(module: nn.Module,
                                       execution_device: Device | Mapping[str, Device | None] | None = None,
                                       offload: bool | Mapping[str, bool] = False,
                                       weights_map: Mapping[str, torch.Tensor] | None = None,
                                       offload_buffers: bool = False, module_name: str = "",
                                       skip_keys: str | Sequence[str] | None = None,
                                       preload_module_classes: Sequence[str] | None = None) -> None:
    """Hook each block named in ``execution_device`` / ``offload`` (dicts by dotted name) as a device map says.

    A block that is not offloaded gets one hook that places it (and its submodules) on its
    device; an offloaded block gets :func:`attach_align_device_hook`'s per-module hooks reading
    ``weights_map``; the root (``""``) otherwise gets a hook that returns outputs on the inputs'
    device. With neither argument a dict, the whole ``module`` is one block. As in Accelerate.

    Args:
        module: the root of the tree (or the block ``module_name`` names).
        execution_device: one device, or ``{block name: device}``.
        offload: one flag, or ``{block name: whether its weights are offloaded}``.
        weights_map: full name -> tensor for offloaded weights.
        offload_buffers: offload buffers too.
        module_name: ``module``'s dotted name.
        skip_keys: keyword arguments not moved.
        preload_module_classes: class names loaded whole before their forward.

    Example:
        >>> m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)); x = torch.ones(1, 2); ref = m(x)
        >>> attach_align_device_hook_on_blocks(m, {"0": "cpu", "1": "cpu"}, {"0": False, "1": True},
        ...                                    weights_map=m.state_dict())
        >>> m[0].weight.device.type, m[1].weight.device.type, torch.equal(m(x), ref)
        ('cpu', 'meta', True)
    """
    devices: Mapping[str, Device | None]
    if isinstance(execution_device, Mapping):
        devices = execution_device
    elif isinstance(offload, Mapping):
        devices = dict.fromkeys(offload, execution_device)
    else:  # neither is a dict: the whole module is one block
        if offload:
            attach_align_device_hook(module, execution_device, True, weights_map, offload_buffers, module_name,
                                     skip_keys)
        else:
            add_hook_to_module(module, AlignDevicesHook(execution_device, io_same_device=True, skip_keys=skip_keys,
                                                        place_submodules=True))
        return
    offloads = offload if isinstance(offload, Mapping) else dict.fromkeys(devices, offload)
    if module_name in devices and module_name in offloads:
        device = devices[module_name]
        if not offloads[module_name]:
            add_hook_to_module(module, AlignDevicesHook(device, offload_buffers=offload_buffers,
                                                        io_same_device=module_name == "", place_submodules=True,
                                                        skip_keys=skip_keys))
            attach_execution_device_hook(module, device, skip_keys=skip_keys)
        else:
            attach_align_device_hook(module, device, True, weights_map, offload_buffers, module_name, skip_keys,
                                     preload_module_classes)
            if not hasattr(module, "_hf_hook"):
                add_hook_to_module(module, AlignDevicesHook(device, io_same_device=module_name == "",
                                                            skip_keys=skip_keys))
            attach_execution_device_hook(module, device, skip_keys, preload_module_classes)
    elif module_name == "":
        add_hook_to_module(module, AlignDevicesHook(devices.get(""), io_same_device=True, skip_keys=skip_keys))
    for child_name, child in module.named_children():
        attach_align_device_hook_on_blocks(child, devices, offloads, weights_map, offload_buffers,
                                           f"{module_name}.{child_name}" if module_name else child_name, skip_keys,
                                           preload_module_classes)
