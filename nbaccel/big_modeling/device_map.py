"""Device maps: which device each part of a model lives on, inferred from budgets or checked.

A device map is ``{module or tensor name: device}``, where a device is a GPU index, ``"cpu"``
or ``"disk"`` (``""`` names the whole model). :func:`infer_auto_device_map` fills GPUs first,
then CPU, then disk, never splitting a no-split block; :func:`resolve_device_map` turns the
strings ``"auto"``, ``"balanced"``, ``"balanced_low_0"`` and ``"sequential"`` into a map, and
checks a map given by hand against the model.
"""

from __future__ import annotations

import difflib
import functools
import logging
import math
from collections.abc import Callable, Container, Mapping, Sequence
from typing import Literal, get_args

import torch
from torch import nn

from nbaccel.big_modeling.sizes import (
    MaxMemory,
    compute_module_sizes,
    find_tied_parameters,
    get_balanced_memory,
    get_max_layer_size,
    planning_budget,
    tensor_size,
)
from nbaccel.big_modeling.tensors import Device
from nbaccel.errors import DeviceMapError

__all__ = [
    "DeviceMapStrategy",
    "check_device_map",
    "device_for",
    "infer_auto_device_map",
    "resolve_device_map",
]

DeviceMapStrategy = Literal["auto", "balanced", "balanced_low_0", "sequential"]
MapDevice = int | str  # normalized: GPU index, "cpu", "disk", "mps" or "meta"
Piece = tuple[str, nn.Module | torch.Tensor]  # a module or tensor to place, by full name
_NAMED = ("cpu", "disk", "mps", "meta")
_log = logging.getLogger(__name__)


def infer_auto_device_map(model: nn.Module, max_memory: MaxMemory | None = None,
                          no_split_module_classes: Sequence[str] | None = None,
                          dtype: torch.dtype | str | None = None,
                          special_dtypes: Mapping[str, torch.dtype] | None = None,
                          verbose: bool = False, clean_result: bool = True,
                          offload_buffers: bool = False,
                          fallback_allocation: bool = False) -> dict[str, MapDevice]:
    """Place a model's modules on GPUs first, then CPU, then disk, within ``max_memory``.

    Modules are placed in the order they are defined; a module that does not fit is split into
    its children unless its class is in ``no_split_module_classes``. When part of the model
    is offloaded, the main devices (the first GPU and the CPU; the CPU alone without GPUs)
    keep room for the largest piece still to be placed, because offloaded weights are loaded
    there to run; as in Accelerate, except that nothing is kept back when nothing ends up
    offloaded.

    Args:
        model: the model (usually built with ``init_empty_weights``).
        max_memory: ``{device: size}``; measured with :func:`get_max_memory` when ``None``.
        no_split_module_classes: class names kept whole (for example a transformer block).
        dtype: the dtype the weights will be loaded in.
        special_dtypes: ``{tensor name: dtype}`` exceptions to ``dtype``.
        verbose: log each decision (logger ``nbaccel.big_modeling.device_map``).
        clean_result: merge children placed on one device into their parent.
        offload_buffers: offload the buffers of offloaded modules with their weights. When
            ``False`` (the default) those buffers stay on the main device (the first GPU, else
            the CPU) while the model runs, so their bytes are counted against it here, where
            Accelerate only warns that they may not fit.
        fallback_allocation: when a GPU or CPU would be left empty because the next piece is a
            block too big for it, put there the first later piece that fits (searching inside
            splittable modules) instead, so no device with a budget goes unused.

    Returns:
        ``{name: device}`` covering the whole model.

    Example:
        >>> m = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])  # 288 B each
        >>> infer_auto_device_map(m, {"cpu": 700})
        {'0': 'cpu', '1': 'disk', '2': 'disk', '3': 'disk'}
    """
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."))
    if isinstance(no_split_module_classes, str):
        no_split_module_classes = [no_split_module_classes]
    planner = _Planner(model, planning_budget(max_memory), list(no_split_module_classes or ()),
                       dtype, dict(special_dtypes or {}), fallback_allocation, verbose)
    reserve, held = False, 0
    while True:
        device_map = planner.place(reserve, held)
        offloaded = [n for n, d in device_map.items() if d in planner.offloaded]
        if offloaded and not reserve:
            reserve = True
        elif not offload_buffers and (need := planner.buffer_bytes(offloaded)) > held:
            held = need  # more offloaded buffers than room kept for them: place again
        else:
            break
        if verbose:
            _log.info("placing again, keeping room to run offloaded pieces on %r and %d bytes "
                      "for their buffers on %r", planner.main, held, planner.holder)
    return _clean(model, device_map) if clean_result else device_map


class _Planner:
    """One model and one budget, placed piece by piece by :meth:`place`."""

    def __init__(self, model: nn.Module, budget: dict[MapDevice, int], no_split: list[str],
                 dtype: torch.dtype | None, special: dict[str, torch.dtype],
                 fallback_allocation: bool, verbose: bool) -> None:
        self.model, self.budget, self.no_split = model, budget, no_split
        self.dtype, self.special = dtype, special
        self.fallback_allocation, self.verbose = fallback_allocation, verbose
        self.devices: list[MapDevice] = [d for d in budget if d != "disk" and budget[d] > 0]
        self.devices.append("disk")
        gpus = [d for d in self.devices if isinstance(d, int)]
        # where offloaded pieces run (as dispatch_model picks it), and which devices they come from
        self.holder: MapDevice = gpus[0] if gpus else "mps" if "mps" in self.devices else "cpu"
        self.main = {gpus[0], "cpu"} if gpus else {self.holder}
        self.offloaded = ("cpu", "disk") if gpus else ("disk",)
        self.sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special)
        self.tied = _tied_aliases(model)

    def buffer_bytes(self, names: Sequence[str]) -> int:
        """Bytes of the buffers inside the entries ``names``, in the dtype they load in."""
        return sum(tensor_size(b, self.special.get(n, self.dtype))
                   for n, b in self.model.named_buffers() if any(_inside(n, p) for p in names))

    def _largest(self, queue: Sequence[Piece]) -> tuple[int, list[str]]:
        modules = [(n, p) for n, p in queue if isinstance(p, nn.Module)]
        return get_max_layer_size(modules, self.sizes, self.no_split)

    def place(self, reserve: bool, held: int) -> dict[str, MapDevice]:
        """A raw map; with ``reserve``, the main devices keep room for the largest piece not
        yet placed, and ``held`` bytes are kept on the holder for offloaded buffers."""
        queue, device_map = _pieces(self.model, ""), {}
        largest, largest_names = self._largest(queue) if reserve else (0, [])
        index, used = 0, 0
        while queue:
            name, piece = queue.pop(0)
            largest_names = [n for n in largest_names if not _inside(n, name)]
            if reserve and not largest_names:  # the largest pieces are all placed: the next
                largest, largest_names = self._largest(queue)
            device = self.devices[index]
            size = self.sizes[name] + _tied_extra(self.model, name, self.tied, device_map,
                                                  device, self.dtype, self.special)
            limit = math.inf if device == "disk" else self.budget[device] - \
                (largest if device in self.main else 0) - (held if device == self.holder else 0)
            if used + size <= limit:
                device_map[name] = device
                used += size
                if self.verbose:
                    _log.info("put %r (%d bytes) on %r", name, size, device)
                continue
            if _splittable(piece, self.no_split):
                queue = _pieces(piece, name) + queue
                if reserve:
                    largest, largest_names = self._largest(queue)
                continue
            if self.fallback_allocation and used == 0 and device != "disk":
                found = _fallback_piece(queue, limit, self.no_split, functools.partial(
                    self._size_on, device=device, device_map=device_map))
                if found is not None:  # placed next, on this device; the block goes on after
                    queue = [found[0], (name, piece), *found[1]]
                    continue
            if self.verbose:
                _log.info("%r (%d bytes) does not fit on %r (%d of %s used)", name, size,
                          device, used, limit)
            index, used = index + 1, 0
            queue.insert(0, (name, piece))
        return device_map

    def _size_on(self, name: str, device: MapDevice, device_map: Mapping[str, MapDevice]) -> int:
        return self.sizes[name] + _tied_extra(self.model, name, self.tied, device_map, device,
                                              self.dtype, self.special)


def _splittable(piece: nn.Module | torch.Tensor, no_split: Container[str]) -> bool:
    return isinstance(piece, nn.Module) and type(piece).__name__ not in no_split and \
        next(piece.children(), None) is not None


def _fallback_piece(queue: Sequence[Piece], limit: float, no_split: Container[str],
                    size_of: Callable[[str], int]) -> tuple[Piece, list[Piece]] | None:
    """The first piece of ``queue`` that fits in ``limit``, looking inside splittable modules
    depth-first, and the queue without it (its ancestors split); ``None`` if none fits."""
    todo = list(queue)
    while todo:
        name, piece = todo.pop(0)
        if size_of(name) <= limit:
            break
        if _splittable(piece, no_split):
            todo = _pieces(piece, name) + todo
    else:
        return None
    rest = list(queue)
    while all(n != name for n, _ in rest):
        i = next(i for i, (n, _) in enumerate(rest) if name.startswith(f"{n}."))
        rest[i:i + 1] = _pieces(rest[i][1], rest[i][0])
    return (name, piece), [item for item in rest if item[0] != name]


def _pieces(module: nn.Module, prefix: str) -> list[Piece]:
    """A module's direct parameters, children and direct buffers, with full names."""
    dot = f"{prefix}." if prefix else ""
    return [*((dot + n, t) for n, t in module.named_parameters(recurse=False)),
            *((dot + n, c) for n, c in module.named_children()),
            *((dot + n, t) for n, t in module.named_buffers(recurse=False))]


def _tied_aliases(model: nn.Module) -> dict[str, str]:
    """``{alias: canonical}`` for tied parameters; the canonical name is the one counted."""
    counted = {n for n, _ in model.named_parameters()}
    aliases = {}
    for group in find_tied_parameters(model):
        canonical = next(n for n in group if n in counted)
        aliases.update({n: canonical for n in group if n != canonical})
    return aliases


def _inside(name: str, prefix: str) -> bool:
    return not prefix or name == prefix or name.startswith(f"{prefix}.")


def _tied_extra(model: nn.Module, name: str, tied: Mapping[str, str],
                device_map: Mapping[str, MapDevice], device: MapDevice,
                dtype: torch.dtype | None, special_dtypes: Mapping[str, torch.dtype]) -> int:
    """Bytes the tied aliases inside ``name`` cost on ``device``: none where their canonical
    tensor is inside ``name`` too or already lives on ``device``. Sized in the dtype the
    weights will be loaded in, as :func:`compute_module_sizes` sizes every other tensor."""
    extra = 0
    for alias, canonical in tied.items():
        if _inside(alias, name) and not _inside(canonical, name) \
                and device_for(canonical, device_map) != device:
            load_dtype = special_dtypes.get(alias, special_dtypes.get(canonical, dtype))
            extra += tensor_size(model.get_parameter(alias), load_dtype)
    return extra


def _clean(model: nn.Module, device_map: dict[str, MapDevice]) -> dict[str, MapDevice]:
    """Merge entries under one module into that module where they all share a device."""
    for prefix, _ in model.named_modules():
        under = [k for k in device_map if not prefix or k == prefix or k.startswith(f"{prefix}.")]
        if len(under) > 1 and len({device_map[k] for k in under}) == 1:
            device = device_map[under[0]]
            for k in under:
                del device_map[k]
            device_map[prefix] = device
    order = {n: i for i, (n, _) in enumerate([*model.named_modules(),
                                              *model.named_parameters(),
                                              *model.named_buffers()])}
    return dict(sorted(device_map.items(), key=lambda kv: order.get(kv[0], 0)))


def device_for(name: str, device_map: Mapping[str, MapDevice],
               default: MapDevice | None = None) -> MapDevice | None:
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


def _normalize_device(name: str, device: object, gpus: int, planning: bool = False) -> MapDevice:
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


def check_device_map(model: nn.Module, device_map: Mapping[str, Device], *, on_this_machine: bool = False
                     ) -> dict[str, MapDevice]:
    """Check a device map against a model and normalize its devices.

    Every name must be a module or tensor of the model (``""`` is the whole model), every
    device must be a device, and every tensor of the model must be covered. GPUs this machine
    lacks are accepted (a map planned for another machine, as Accelerate accepts it) unless
    ``on_this_machine``, which dispatching and loading ask for.

    Args:
        model: the model.
        device_map: name -> device.
        on_this_machine: also require every GPU the map names to be visible here.

    Raises:
        DeviceMapError: an unknown name or device, or a tensor left unplaced.

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
    for name, device in device_map.items():
        if not isinstance(name, str) or name not in known:
            close = difflib.get_close_matches(str(name), sorted(known - {""}), n=3)
            raise DeviceMapError(
                f"the device map names {name!r}, which is not a module or tensor of "
                f"{type(model).__name__}" + (f"; did you mean {close}?" if close else ".") +
                " Valid names are those of model.named_modules() and model.state_dict(), and "
                "'' for the whole model.", key=str(name), value=device, valid=close)
        normalized[name] = _normalize_device(name, device, gpus, planning=not on_this_machine)
    unplaced = [t for t in tensors if device_for(t, normalized) is None]
    if unplaced:
        raise DeviceMapError(
            f"the device map leaves {len(unplaced)} tensor(s) without a device, first "
            f"{unplaced[:3]}. Add their modules to the map, or add '' as a catch-all.",
            key=unplaced[0], value=None, valid="a device for every tensor")
    return normalized


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
    with room for that many of the largest pieces on the first GPU (see
    :func:`_reserve_slots`), where :func:`infer_auto_device_map`, as Accelerate's, keeps one.

    Raises:
        DeviceMapError: an unknown strategy, or a map that does not fit the model.

    Example:
        >>> resolve_device_map(torch.nn.Linear(2, 2), "auto", max_memory={"cpu": "1GiB"})
        {'': 'cpu'}
    """
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
        inferred = infer_auto_device_map(model, max_memory, no_split_module_classes, dtype,
                                         offload_buffers=offload_buffers)
        device_map = _reserve_slots(model, inferred, max_memory, reserved_slots,
                                    no_split_module_classes, dtype, offload_buffers)
    return check_device_map(model, device_map, on_this_machine=True)


def _reserve_slots(model: nn.Module, device_map: dict[str, MapDevice], max_memory: MaxMemory | None,
                   slots: int, no_split: Sequence[str] | None, dtype: torch.dtype | str | None,
                   offload_buffers: bool) -> dict[str, MapDevice]:
    """The map placed again with ``slots - 1`` more of the largest pieces kept free on the first
    GPU, when ``device_map`` offloads something there: the streamed offload keeps ``slots``
    offloaded layers on that GPU at once (:mod:`.streamed_offload`)."""
    budget = planning_budget(max_memory)
    gpus = [d for d in budget if isinstance(d, int) and budget[d] > 0]
    if slots <= 1 or not gpus or not any(d in ("cpu", "disk") for d in device_map.values()):
        return device_map
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."))
    sizes = compute_module_sizes(model, dtype=dtype)
    largest, _ = get_max_layer_size(list(model.named_children()), sizes, list(no_split or ()))
    budget[gpus[0]] = max(0, budget[gpus[0]] - (slots - 1) * largest)
    _log.info("placing again with %d bytes kept on GPU %d for %d offload slots",
              slots * largest, gpus[0], slots)
    return infer_auto_device_map(model, budget, no_split, dtype, offload_buffers=offload_buffers)
