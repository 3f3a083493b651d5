"""Device maps: which device each part of a model lives on, inferred from budgets or checked.

A device map is ``{module or tensor name: device}``, where a device is a GPU index, ``"cpu"``
or ``"disk"`` (``""`` names the whole model). :func:`infer_auto_device_map` fills GPUs first,
then CPU, then disk, never splitting a no-split block; :func:`resolve_device_map` turns the
strings ``"auto"``, ``"balanced"``, ``"balanced_low_0"`` and ``"sequential"`` into a map, and
checks a map given by hand against the model.
"""

from __future__ import annotations

import difflib
import logging
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import nn

from nbaccel.big_modeling.placement import place
from nbaccel.big_modeling.sizes import (
    MaxMemory,
    compute_module_sizes,
    find_tied_parameters,
    get_balanced_memory,
    get_max_layer_size,
    planning_budget,
)
from nbaccel.big_modeling.map_devices import MapDevice, device_for, normalize_device
from nbaccel.big_modeling.tensors import Device
from nbaccel.errors import DeviceMapError
from nbaccel.introspection import check_tied_parameters_in_config

__all__ = [
    "DeviceMapStrategy",
    "DevicePlan",
    "check_device_map",
    "infer_auto_device_map",
    "plan_device_map",
    "resolve_device_map",
]

DeviceMapStrategy = Literal["auto", "balanced", "balanced_low_0", "sequential"]
_log = logging.getLogger(__name__)


def infer_auto_device_map(model: nn.Module, max_memory: MaxMemory | None = None,
                          no_split_module_classes: Sequence[str] | None = None,
                          dtype: torch.dtype | str | None = None,
                          special_dtypes: Mapping[str, torch.dtype] | None = None,
                          verbose: bool = False, clean_result: bool = True,
                          offload_buffers: bool = False,
                          fallback_allocation: bool = False) -> dict[str, MapDevice]:
    """Place a model's modules on GPUs first, then CPU, then disk, within ``max_memory``.

    The map is the one Accelerate 1.16 makes for the same arguments (the rules are in
    :mod:`nbaccel.big_modeling.placement`): modules in definition order, a module that does not
    fit split into its children unless its class is in ``no_split_module_classes``, tied
    weights kept on one device, and the first GPU and the CPU always keeping room for the
    largest piece still to place (offloaded pieces run there), even when nothing ends up
    offloaded. The cleaned map is ordered as the model is (Accelerate's order varies run to run).

    Args:
        model: the model (usually built with ``init_empty_weights``).
        max_memory: ``{device: size}``; measured with :func:`get_max_memory` when ``None``.
        no_split_module_classes: class names kept whole (for example a transformer block).
        dtype: the dtype the weights will be loaded in.
        special_dtypes: ``{tensor name: dtype}`` exceptions to ``dtype``.
        verbose: print each decision.
        clean_result: merge children placed on one device into their parent.
        offload_buffers: offload the buffers of offloaded modules with their weights. When
            ``False`` (the default) they stay on the execution device while the model runs,
            and a warning says so when they fit beside no GPU's load; placement is the same.
        fallback_allocation: when a GPU or CPU would be left empty because the next piece is
            too big for it, put there the first later piece that fits (searching inside
            splittable modules) instead.

    Returns:
        ``{name: device}``.

    Example:
        >>> m = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])  # 288 B each
        >>> infer_auto_device_map(m, {"cpu": 700})
        {'0': 'cpu', '1': 'disk', '2': 'disk', '3': 'disk'}
    """
    placement = _Placement.of(model, no_split_module_classes, dtype, special_dtypes, offload_buffers,
                              fallback_allocation, verbose)
    # place() itself, not placement.place: its buffer warning points stacklevel=4 at this function's caller
    device_map = place(model, planning_budget(max_memory), placement.no_split, placement.dtype, placement.special,
                       placement.tied, fallback_allocation, offload_buffers, verbose)
    return _clean(model, device_map) if clean_result else device_map


@dataclass(frozen=True)
class _Placement:
    """One model's placement inputs, prepared once (dtype, no-split classes, tied groups), placed
    against one budget or, when offload slots are reserved, against a few."""

    model: nn.Module
    no_split: list[str]
    dtype: torch.dtype | None
    special: dict[str, torch.dtype]
    tied: list[list[str]]
    offload_buffers: bool
    fallback_allocation: bool = False
    verbose: bool = False

    @classmethod
    def of(cls, model: nn.Module, no_split_module_classes: Sequence[str] | str | None,
           dtype: torch.dtype | str | None, special_dtypes: Mapping[str, torch.dtype] | None,
           offload_buffers: bool, fallback_allocation: bool = False, verbose: bool = False) -> _Placement:
        """The inputs prepared: ``dtype`` as a ``torch.dtype``, no-split classes as a list, tied groups found."""
        as_dtype: torch.dtype | None = getattr(torch, dtype.removeprefix("torch.")) if isinstance(dtype, str) else dtype
        if isinstance(no_split_module_classes, str):
            no_split_module_classes = [no_split_module_classes]
        tied = find_tied_parameters(model)
        if not tied and check_tied_parameters_in_config(model):  # as Accelerate: a map for untied weights
            _log.warning("the model's config ties weights, but its weights are not tied, so they may be "
                         "placed apart. Fix: call model.tie_weights() before infer_auto_device_map.")
        return cls(model, list(no_split_module_classes or ()), as_dtype, dict(special_dtypes or {}), tied,
                   offload_buffers, fallback_allocation, verbose)

    def place(self, budget: dict[MapDevice, int]) -> dict[str, MapDevice]:
        """The raw (uncleaned) map for ``budget``."""
        return place(self.model, budget, self.no_split, self.dtype, self.special, self.tied,
                     self.fallback_allocation, self.offload_buffers, self.verbose)

    def largest_layer(self) -> int:
        """Bytes of the largest piece that is never split (a leaf, or a no-split block)."""
        sizes = compute_module_sizes(self.model, dtype=self.dtype, special_dtypes=self.special)
        return get_max_layer_size(list(self.model.named_children()), sizes, self.no_split)[0]


def _clean(model: nn.Module, device_map: dict[str, MapDevice]) -> dict[str, MapDevice]:
    """Merge the entries under a name into that name where there are several, all on one
    device, from the top down; then order the entries as the model defines them."""
    todo = [""]
    while todo:
        prefix = todo.pop(0)
        dot = f"{prefix}." if prefix else ""
        under = [k for k in device_map if k.startswith(dot) and k != prefix]
        if len(under) > 1 and len({device_map[k] for k in under}) == 1:
            device = device_map[under[0]]
            for k in under:
                del device_map[k]
            device_map[prefix] = device
            continue
        depth = len(prefix.split(".")) + 1 if prefix else 1
        todo += sorted({".".join(k.split(".")[:depth]) for k in under})
    names = [n for n, _ in model.named_modules(remove_duplicate=False)]
    names += [n for n, _ in [*model.named_parameters(remove_duplicate=False),
                             *model.named_buffers(remove_duplicate=False)]]
    order = {n: i for i, n in reversed(list(enumerate(names)))}
    return dict(sorted(device_map.items(), key=lambda kv: order.get(kv[0], len(order))))


def check_device_map(model: nn.Module, device_map: Mapping[str, Device], *, on_this_machine: bool = False
                     ) -> dict[str, MapDevice]:
    """Check a device map against a model and normalize its devices.

    Every device must be a device and every tensor of the model must be covered. A name that
    is no module or tensor of the model is dropped with a ``UserWarning`` naming close ones
    (Accelerate warns and goes on too). A direct buffer of a module that the map splits (the
    device map planner never places those, as in Accelerate) goes where that module's first
    placed part goes. GPUs this machine lacks are accepted (a map planned for another
    machine, as Accelerate accepts it) unless ``on_this_machine``, which dispatching and
    loading ask for.

    Args:
        model: the model.
        device_map: name -> device.
        on_this_machine: also require every GPU the map names to be visible here.

    Returns:
        The map with normalized devices, unknown names dropped, split modules' buffers added.

    Raises:
        DeviceMapError: a map that is not a dict, an unknown device, or a tensor left unplaced.

    Example:
        >>> check_device_map(torch.nn.Linear(2, 2), {"": torch.device("cpu")})
        {'': 'cpu'}
    """
    from nbaccel.hardware import cuda_device_count

    if not isinstance(device_map, Mapping):
        raise DeviceMapError(
            f"device_map must be a dict of name -> device or one of "
            f"{list(get_args(DeviceMapStrategy))} (got {device_map!r} of type "
            f"{type(device_map).__name__}). For the whole model on CPU: device_map={{'': 'cpu'}}.",
            key="device_map", value=device_map, valid=list(get_args(DeviceMapStrategy)))
    gpus = cuda_device_count()
    names = {n for n, _ in model.named_modules(remove_duplicate=False)}
    tensors = [n for n, _ in [*model.named_parameters(remove_duplicate=False),
                              *model.named_buffers(remove_duplicate=False)]]
    known = names | set(tensors)
    normalized: dict[str, MapDevice] = {}
    unknown = [n for n in device_map if not isinstance(n, str) or n not in known]
    if unknown:
        close = {str(n): difflib.get_close_matches(str(n), sorted(known - {""}), n=3)
                 for n in unknown}
        warnings.warn(
            f"the device map names {unknown}, which are no modules or tensors of "
            f"{type(model).__name__} (close names: {close}); they are ignored. Valid names are "
            "those of model.named_modules() and model.state_dict(), and '' for the whole model.",
            UserWarning, stacklevel=2)
    for name, device in device_map.items():
        if name not in unknown:
            normalized[name] = normalize_device(name, device, gpus, planning=not on_this_machine)
    _place_split_modules_buffers(model, normalized)
    unplaced = [t for t in tensors if device_for(t, normalized) is None]
    if unplaced:
        raise DeviceMapError(
            "The device_map provided does not give any device for the following parameters: "  # Accelerate's words
            f"{', '.join(unplaced)}. Fix: add their modules to the map, or add '' as a catch-all.",
            key=unplaced[0], value=None, valid="a device for every tensor")
    return normalized


def _place_split_modules_buffers(model: nn.Module, device_map: dict[str, MapDevice]) -> None:
    """Give each unplaced direct buffer of a module with placed parts that module's first part's device."""
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        parts = [k for k in device_map if k.startswith(dot) and k != prefix]
        if not parts or device_for(prefix, device_map) is not None:
            continue
        for name, _ in module.named_buffers(recurse=False):
            device_map.setdefault(dot + name, device_map[parts[0]])


@dataclass(frozen=True)
class DevicePlan:
    """A checked device map, how many offload slots its first GPU keeps room for, and where
    offloaded parts run (the first GPU of the budget whenever there is one, even when the map
    puts nothing else on it; ``None``: as ``dispatch_model`` chooses)."""

    device_map: dict[str, MapDevice]
    slots: int
    main_device: MapDevice | None = None


def resolve_device_map(model: nn.Module, device_map: DeviceMapStrategy | Mapping[str, Device],
                       max_memory: MaxMemory | None = None,
                       no_split_module_classes: Sequence[str] | None = None,
                       dtype: torch.dtype | str | None = None,
                       offload_buffers: bool = False,
                       reserved_slots: int = 1) -> dict[str, MapDevice]:
    """A checked device map, inferring one from a strategy name.

    ``"auto"`` and ``"balanced"`` spread the model evenly over the GPUs, ``"balanced_low_0"``
    keeps GPU 0 as free as possible, ``"sequential"`` fills each GPU in turn; each then
    overflows to CPU and disk. On a CPU-only machine all four fill CPU, then disk. With
    ``reserved_slots`` above 1, an inferred map that offloads part of the model is placed again
    with room for up to that many of the largest pieces on the first GPU (see
    :func:`plan_device_map`), where :func:`infer_auto_device_map`, as Accelerate's, keeps one.

    Raises:
        DeviceMapError: an unknown strategy, or a map that does not fit the model.

    Example:
        >>> resolve_device_map(torch.nn.Linear(2, 2), "auto", max_memory={"cpu": "1GiB"})
        {'': 'cpu'}
    """
    return plan_device_map(model, device_map, max_memory, no_split_module_classes, dtype,
                           offload_buffers, reserved_slots).device_map


def plan_device_map(model: nn.Module, device_map: DeviceMapStrategy | Mapping[str, Device],
                    max_memory: MaxMemory | None = None,
                    no_split_module_classes: Sequence[str] | None = None,
                    dtype: torch.dtype | str | None = None, offload_buffers: bool = False,
                    reserved_slots: int = 1) -> DevicePlan:
    """:func:`resolve_device_map`, with the offload slots kept and the execution device.

    The slot reservation never takes the first GPU's last layer: when its budget cannot hold
    ``reserved_slots`` slots beside what Accelerate's placement puts there, fewer are kept and a
    ``UserWarning`` says so; offloaded parts still run on that GPU.

    Raises:
        DeviceMapError: as :func:`resolve_device_map`.

    Example:
        >>> plan_device_map(torch.nn.Linear(2, 2), "auto", max_memory={"cpu": "1GiB"})
        DevicePlan(device_map={'': 'cpu'}, slots=1, main_device=None)
    """
    slots, main = 1, None
    if isinstance(device_map, str):
        strategies = get_args(DeviceMapStrategy)
        if device_map not in strategies:
            raise DeviceMapError(
                f"device_map={device_map!r} is not a strategy. Valid strategies: "
                f"{list(strategies)}; or pass a dict, e.g. device_map={{'': {device_map!r}}} "
                "to put the whole model on one device.",
                key="device_map", value=device_map, valid=list(strategies))
        if device_map != "sequential":
            max_memory = get_balanced_memory(model, max_memory, no_split_module_classes, dtype,
                                             low_zero=device_map == "balanced_low_0")
        budget = planning_budget(max_memory)  # measured once (when None), for every pass below
        placement = _Placement.of(model, no_split_module_classes, dtype, None, offload_buffers)
        device_map, slots = _reserve_slots(placement, budget, reserved_slots)
        gpus = [d for d in budget if isinstance(d, int)]
        main = gpus[0] if gpus else None
    return DevicePlan(check_device_map(model, device_map, on_this_machine=True), slots, main)


def _reserve_slots(placement: _Placement, budget: dict[MapDevice, int], slots: int
                   ) -> tuple[dict[str, MapDevice], int]:
    """The cleaned map for ``budget``, placed again with up to ``slots - 1`` more of the largest
    pieces kept free on the first GPU when that map offloads something there (the streamed
    offload keeps that many offloaded layers on that GPU at once, :mod:`.streamed_offload`), and
    how many were kept: the most that leave the first GPU holding something whenever
    Accelerate's map does.

    Accelerate's map is placed first and a reserving map only when it offloads: the reserve
    changes where the first GPU's pieces end, so the two maps differ, and whether to reserve is
    known only from the first (a model that fits places as Accelerate places it). So an
    offloading GPU map takes two placements, three when the first GPU cannot keep ``slots`` and
    still hold a layer (``slots - 1`` reserving passes at most); the preparation they share
    (dtype, tied groups, sizes, the budget) is done once.
    """
    model = placement.model
    device_map = placement.place(budget)
    gpus = [d for d in budget if isinstance(d, int) and budget[d] > 0]
    if slots <= 1 or not gpus or not any(d in ("cpu", "disk") for d in device_map.values()):
        return _clean(model, device_map), 1
    largest = placement.largest_layer()
    count, placed = 1, device_map
    if gpus[0] not in device_map.values():  # nothing there to keep: as many slots as the budget holds
        count = max(1, min(slots, budget[gpus[0]] // max(1, largest)))
    for fewer_slots in range(slots, 1, -1) if gpus[0] in device_map.values() else ():
        fewer = dict(budget)
        fewer[gpus[0]] = max(0, budget[gpus[0]] - (fewer_slots - 1) * largest)
        again = placement.place(fewer)
        if gpus[0] in again.values():
            count, placed = fewer_slots, again
            break
    if count < slots:
        warnings.warn(
            f"GPU {gpus[0]}'s budget ({budget[gpus[0]]} bytes) has room for only {count} of {slots} "
            f"offload slots of {largest} bytes beside the layers placed there: offloaded layers "
            f"still run on GPU {gpus[0]}, streamed through {count} slot(s), so less of their copy "
            f"hides behind compute. Fix: raise max_memory[{gpus[0]}] by "
            f"{(slots - count) * largest} bytes.", UserWarning, stacklevel=4)
    _log.info("placing with %d bytes kept on GPU %d for %d offload slots", count * largest, gpus[0], count)
    return _clean(model, placed), count
