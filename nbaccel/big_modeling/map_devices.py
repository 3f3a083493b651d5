"""One device as a device map writes it, and which device a name gets from a map.

A device map's values are normalized to a :data:`MapDevice`: a GPU index, ``"cpu"``, ``"disk"``,
``"mps"`` or ``"meta"``. The planner (:mod:`nbaccel.big_modeling.device_map`), dispatch and loading
all read devices through here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import torch

from nbaccel.big_modeling.tensors import Device
from nbaccel.errors import DeviceMapError

__all__ = ["MapDevice", "device_for", "map_device", "normalize_device"]

MapDevice = int | str  # normalized: GPU index, "cpu", "disk", "mps" or "meta"
_D = TypeVar("_D")  # a device map's values: MapDevice once checked, Device as a user wrote them
_NAMED = ("cpu", "disk", "mps", "meta")


def device_for(name: str, device_map: Mapping[str, _D], default: _D | None = None) -> _D | None:
    """The device of tensor or module ``name``: the entry with the longest matching prefix.

    Example:
        >>> device_for("blocks.3.fc.weight", {"blocks": "cpu", "blocks.3": "disk"})
        'disk'
    """
    parts = name.split(".")
    for i in range(len(parts), -1, -1):
        key = ".".join(parts[:i])
        if key in device_map:
            return device_map[key]
    return default


def normalize_device(name: str, device: object, gpus: int, planning: bool = False) -> MapDevice:
    """``device`` (the map's entry for ``name``) as a :data:`MapDevice`, given ``gpus`` visible GPUs.

    Raises:
        DeviceMapError: not a device, or a GPU index this machine lacks (any index while ``planning``).
    """
    valid = (f"GPU indices 0..{gpus - 1}, 'cuda:N', " if gpus else "") + \
        "'cpu', 'disk', 'mps', 'meta'"
    if isinstance(device, torch.device):
        device = device.type if device.index is None else f"{device.type}:{device.index}"
    if device == "cuda":
        device = 0
    if isinstance(device, str) and device.startswith("cuda:") and device[5:].isdigit():
        device = int(device[5:])
    if isinstance(device, int) and not isinstance(device, bool):
        if 0 <= device < gpus or (planning and device >= 0):
            return device
        raise DeviceMapError(
            f"the device map puts {name!r} on GPU {device}, but this machine has {gpus} visible "
            f"GPU(s). Valid devices: {valid}. Use 'cpu' or 'disk' there, or "
            "device_map='auto' to choose.", key=name, value=device, valid=valid)
    if device in _NAMED:
        return device
    raise DeviceMapError(
        f"the device map puts {name!r} on {device!r} ({type(device).__name__}), which is not a "
        f"device. Valid devices: {valid}. For example: {{{name!r}: 'cpu'}}.",
        key=name, value=device, valid=valid)


def map_device(device: Device, *, on_this_machine: bool = True) -> MapDevice:
    """One device as a device map writes it: a GPU index, ``"cpu"``, ``"disk"``, ``"mps"`` or ``"meta"``.

    Args:
        device: a GPU index, ``"cuda"``, ``"cuda:N"``, a ``torch.device``, or a named device.
        on_this_machine: require a GPU to be visible here (``False``: any index, as planning accepts).

    Raises:
        DeviceMapError: not a device, or (``on_this_machine``) a GPU this machine lacks.

    Example:
        >>> map_device(torch.device("cpu")), map_device("cuda:1", on_this_machine=False)
        ('cpu', 1)
    """
    from nbaccel.hardware import cuda_device_count

    return normalize_device("", device, cuda_device_count(), planning=not on_this_machine)
