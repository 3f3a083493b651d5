"""Placement: the walk that turns a model and per-device budgets into a raw device map.

What always holds: for the same model, budget and arguments, the map is the one Accelerate 1.16's
``infer_auto_device_map`` makes (before cleaning), so a user's map, and whether the model fits,
do not change with the import. The rules, as facts of that algorithm:

- Devices are taken in budget order (GPUs, ``"mps"``, CPU), disk last; a device with a zero
  budget still counts (it takes nothing). The *main* devices, the first GPU and the CPU (only
  ``"mps"`` when it is there; the CPU alone without GPUs), always keep room for the largest
  piece still to be placed, because offloaded pieces are brought there to run.
- The queue starts with the model's direct parameters, children, then direct buffers. A piece
  that does not fit is replaced by its direct parameters and children (not its direct buffers,
  which stay unplaced unless cleaning merges their module), unless its class is no-split.
- A piece whose parameters are tied to parameters outside it goes together with the queued
  pieces holding them (one device, its size plus theirs); when only it fits, the first
  splittable such piece is split first. "Outside" is a substring test on ``name + "."``.
- A piece that fits exactly is placed; one that cannot be placed moves the walk to the next
  device. With ``fallback_allocation``, a device about to stay empty first takes the first
  queued piece (searching inside splittable ones) that fits beside room for the largest piece.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from nbaccel.big_modeling.map_devices import MapDevice
from nbaccel.big_modeling.sizes import compute_module_sizes, get_max_layer_size

__all__ = ["Piece", "place"]

Piece = tuple[str, nn.Module | torch.Tensor]  # a module or tensor to place, by full name


def _inside(name: str, key: str) -> bool:
    # Accelerate tests membership as a substring, so "0" is "inside" "layers.0.weight" too
    return f"{name}." in f"{key}."


def _split(piece: nn.Module | torch.Tensor, name: str) -> list[Piece]:
    """A split module's pieces: its direct parameters, then its children (no direct buffers)."""
    if not isinstance(piece, nn.Module):
        return []
    parts: list[Piece] = [*piece.named_parameters(recurse=False), *piece.named_children()]
    return [(f"{name}.{n}", t) for n, t in parts]


def _splittable(piece: nn.Module | torch.Tensor, no_split: Sequence[str]) -> bool:
    return isinstance(piece, nn.Module) and type(piece).__name__ not in no_split and \
        next(piece.children(), None) is not None


@dataclass
class _Walk:
    """One model, one budget; :meth:`run` places it piece by piece."""

    model: nn.Module
    budget: dict[MapDevice, int]
    no_split: list[str]
    dtype: torch.dtype | None
    special: dict[str, torch.dtype]
    tied: list[list[str]]
    verbose: bool = False
    devices: list[MapDevice] = field(init=False)
    main: list[MapDevice] = field(init=False)
    sizes: Mapping[str, int] = field(init=False)
    used: dict[MapDevice, int] = field(init=False)
    buffers: dict[MapDevice, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.devices = [*self.budget, *(["disk"] if "disk" not in self.budget else [])]
        gpus = [d for d in self.devices if d not in ("cpu", "disk")]
        self.main = ["mps"] if "mps" in gpus else [gpus[0], "cpu"] if gpus else ["cpu"]
        self.sizes = compute_module_sizes(self.model, self.dtype, self.special)
        self.used = dict.fromkeys(self.devices, 0)

    def size(self, name: str) -> int:
        return self.sizes.get(name, 0)

    def largest(self, queue: Sequence[Piece], tensors_too: bool = False) -> tuple[int, list[str]]:
        pieces = [(n, p) for n, p in queue if tensors_too or isinstance(p, nn.Module)]
        return get_max_layer_size(pieces, self.sizes, self.no_split)

    def tied_outside(self, name: str) -> list[str]:
        """Parameters tied to one inside ``name`` but themselves outside it."""
        outside = []
        for group in self.tied:
            inside = [_inside(name, k) for k in group]
            if any(inside) and not all(inside):
                outside += [k for k, i in zip(group, inside) if not i]
        return outside

    def with_ties(self, name: str, tied: Sequence[str], queue: Sequence[Piece]
                  ) -> tuple[int, list[Piece]]:
        """``name``'s size plus the queued pieces holding ``tied``, and those pieces."""
        total, holders = self.size(name), []
        for param in tied:
            holder = next(((n, p) for n, p in queue
                           if param == n or param.startswith(f"{n}.")), None)
            if holder is None:  # already placed elsewhere (Accelerate stops with an IndexError)
                continue
            holders.append(holder)
            total += self.size(holder[0]) - self.size(param)
        return total, holders

    def put(self, name: str, piece: nn.Module | torch.Tensor, device: MapDevice, size: int,
            holders: Sequence[Piece], queue: list[Piece], device_map: dict[str, MapDevice],
            offload_buffers: bool) -> None:
        self.used[device] += size
        device_map[name] = device
        for holder, _ in holders:
            index = next((i for i, (n, _) in enumerate(queue) if n == holder), None)
            if index is not None:
                queue.pop(index)
            device_map[holder] = device
        if not offload_buffers and isinstance(piece, nn.Module):
            bytes_ = compute_module_sizes(piece, self.dtype, self.special, buffers_only=True)
            self.buffers[device] = self.buffers.get(device, 0) + bytes_.get("", 0)
        if self.verbose:
            print(f"put {name!r} ({size} bytes, with {[h for h, _ in holders]}) on {device!r}")

    def split_tied(self, current: Piece, holders: Sequence[Piece], queue: list[Piece]
                   ) -> list[Piece] | None:
        """The queue with the first splittable tied holder split, ``current`` first again."""
        for holder, piece in holders:
            if not _splittable(piece, self.no_split):
                continue
            index = next(i for i, (n, _) in enumerate(queue) if n == holder)
            return [current, *queue[:index], *_split(piece, holder), *queue[index + 1:]]
        return None


def place(model: nn.Module, budget: dict[MapDevice, int], no_split: list[str],
          dtype: torch.dtype | None, special: dict[str, torch.dtype], tied: list[list[str]],
          fallback_allocation: bool, offload_buffers: bool, verbose: bool
          ) -> dict[str, MapDevice]:
    """The raw (uncleaned) device map; see the module docstring for the rules.

    Example:
        >>> m = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])  # 288 B each
        >>> place(m, {"cpu": 600}, [], None, {}, [], False, True, False)  # room kept for one
        {'0': 'cpu', '1': 'disk', '2': 'disk'}
    """
    walk = _Walk(model, budget, no_split, dtype, special, tied, verbose)
    queue: list[Piece] = [*model.named_parameters(recurse=False), *model.named_children(),
                          *model.named_buffers(recurse=False)]
    layer, layer_names = walk.largest(queue, tensors_too=True)
    device_map: dict[str, MapDevice] = {}
    index = 0
    while queue:
        name, piece = queue.pop(0)
        layer_names = [n for n in layer_names if n != name and not n.startswith(f"{name}.")]
        if not layer_names:
            layer, layer_names = walk.largest(queue)
        size, tied_params = walk.size(name), walk.tied_outside(name)
        device = walk.devices[index]
        reserved = layer if device in walk.main else 0
        limit = None if device == "disk" else budget[device] - reserved
        total, holders = walk.with_ties(name, tied_params, queue)
        if limit is None or walk.used[device] + total <= limit:
            walk.put(name, piece, device, total, holders, queue, device_map, offload_buffers)
            continue
        if tied_params and walk.used[device] + size <= limit:
            split = walk.split_tied((name, piece), holders, queue)
            if split is not None:
                queue = split
                layer, layer_names = walk.largest(queue)
                continue
        if walk.used[device] + size >= limit and _splittable(piece, no_split):
            queue = _split(piece, name) + queue
            layer, layer_names = walk.largest(queue)
            continue
        if fallback_allocation and walk.used[device] == 0 and device != "disk":
            found = _fallback(walk, queue, budget[device] - max(layer, total))
            if found is not None:
                queue = [found[0], (name, piece), *found[1]]
                continue
        if verbose:
            print(f"{name!r} ({total} bytes) does not fit on {device!r}; next device")
        walk.used[device] += reserved
        index += 1
        queue.insert(0, (name, piece))
    _warn_offloaded_buffers(walk, offload_buffers)
    return device_map


def _fallback(walk: _Walk, queue: Sequence[Piece], limit: int
              ) -> tuple[Piece, list[Piece]] | None:
    """The first queued piece (depth first, inside splittable ones) whose size with its tied
    holders is at most ``limit``, and the queue without it, its ancestors split."""
    if limit < 0:
        return None
    todo = list(queue)
    while todo:
        name, piece = todo.pop(0)
        if walk.with_ties(name, walk.tied_outside(name), todo)[0] <= limit:
            break
        if _splittable(piece, walk.no_split):
            todo = _split(piece, name) + todo
    else:
        return None
    rest = list(queue)
    for i, char in enumerate(name):
        names = [n for n, _ in rest]
        if char == "." and name[:i] in names:
            at = names.index(name[:i])
            rest[at:at + 1] = _split(rest[at][1], name[:i])
    at = [n for n, _ in rest].index(name)
    return rest.pop(at), rest


def _warn_offloaded_buffers(walk: _Walk, offload_buffers: bool) -> None:
    """Warn when the buffers kept back from offloaded pieces fit beside no GPU's load."""
    held = walk.buffers.get("cpu", 0) + walk.buffers.get("disk", 0)
    gpus = [d for d in walk.budget if d not in ("cpu", "disk")]
    if held <= 0 or offload_buffers or not gpus:
        return
    if not any(walk.budget[g] >= held + walk.used.get(g, 0) for g in gpus):
        warnings.warn(
            f"the buffers of the offloaded modules take {held} bytes and stay on the execution "
            "device while the model runs, which leaves no GPU within its budget. Fix: pass "
            "offload_buffers=True to offload them with their weights.", stacklevel=4)
