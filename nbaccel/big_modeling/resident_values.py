"""Where a resident weight's values come from while a checkpoint loads, copying only where needed.

GPU-bound safetensors weights are read by reader threads for all GPUs at once
(:func:`staged_to_gpus`); CPU-bound ones that cannot be views of their file are copied by one
thread pool (:func:`copied_to_cpu`); both report each key as its bytes land, and the caller's
thread draws the "Loading checkpoint shards" bar meanwhile; everything else is a view of its
file's map or, from a pickle, what ``torch.load`` gave (:func:`resident_value`). Each value is
handed out once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence

import torch

from nbaccel.big_modeling.checkpoint_files import TensorInfo, can_map
from nbaccel.big_modeling.checkpoint_layout import Checkpoint
from nbaccel.big_modeling.cpu_copies import copy_to_cpu
from nbaccel.big_modeling.map_devices import MapDevice
from nbaccel.big_modeling.device_reads import read_to_devices
from nbaccel.big_modeling.load_progress import ShardProgress
from nbaccel.big_modeling.resident import FileMaps

__all__ = ["copied_to_cpu", "resident_value", "staged_to_gpus"]


def staged_to_gpus(ckpt: Checkpoint, sources: Mapping[str, str], homes: Mapping[str, MapDevice],
                    progress: ShardProgress) -> dict[tuple[str, MapDevice], torch.Tensor]:
    """``{(checkpoint key, GPU): tensor}`` for the GPU-bound safetensors weights, in their stored
    dtype, read by reader threads for all GPUs at once."""
    wanted: dict[tuple[str, int], TensorInfo] = {}
    for name, key in sources.items():
        info, home = ckpt.location(key), homes[name]
        if info is not None and isinstance(home, int):
            wanted[(key, home)] = info
    if not wanted:
        return {}
    infos = list(wanted.values())
    tensors = read_to_devices(infos, [torch.device("cuda", gpu) for _, gpu in wanted],
                              on_piece=_reporter([key for key, _ in wanted], infos, progress),
                              on_wait=progress.tick, wake=progress.moved)
    return dict(zip(wanted, tensors))


def _reporter(keys: Sequence[str], infos: Sequence[TensorInfo],
              progress: ShardProgress) -> Callable[[int, int], None]:
    """``on_piece`` for the readers: a key is done once all its stored bytes are reported."""
    left, lock = [i.nbytes for i in infos], threading.Lock()

    def report(k: int, nbytes: int) -> None:
        with lock:
            left[k] -= nbytes
            finished = left[k] == 0
        if finished:
            progress.done(keys[k])
    return report


def copied_to_cpu(ckpt: Checkpoint, sources: Mapping[str, str], homes: Mapping[str, MapDevice],
                   targets: Mapping[str, torch.dtype], maps: FileMaps,
                   progress: ShardProgress | None = None) -> dict[tuple[str, torch.dtype], torch.Tensor]:
    """``{(checkpoint key, dtype): tensor}`` for the CPU-bound safetensors weights that cannot be
    views of their file (off the 64-byte alignment, or cast to another dtype), copied by one
    thread pool for the whole load; a cast reads straight from the file's map."""
    wanted: dict[tuple[str, torch.dtype], TensorInfo] = {}
    for name, key in sources.items():
        info = ckpt.location(key)
        if info is not None and homes[name] == "cpu" and (targets[name] != info.dtype or not can_map(info)):
            wanted[(key, targets[name])] = info
    infos = list(wanted.values())
    dtypes = [dtype for _, dtype in wanted]
    if progress is None or not infos:
        tensors = copy_to_cpu(infos, dtypes, view=maps.view)
    else:
        tensors = copy_to_cpu(infos, dtypes, view=maps.view,
                              on_piece=_reporter([key for key, _ in wanted], infos, progress),
                              on_wait=progress.tick, wake=progress.moved)
    return dict(zip(wanted, tensors))


def resident_value(ckpt: Checkpoint, key: str, home: MapDevice, target: torch.dtype, maps: FileMaps,
                    staged: dict[tuple[str, MapDevice], torch.Tensor],
                    copied: dict[tuple[str, torch.dtype], torch.Tensor]) -> torch.Tensor:
    """The stored tensor, without a copy where one is not needed: staged on its GPU, copied
    already on CPU, a view of its file on CPU, else read (pickles: as ``torch.load`` gave it)."""
    value = staged.pop((key, home), None)
    if value is None and home == "cpu":
        value = copied.pop((key, target), None)
    if value is not None:
        return value
    info = ckpt.location(key)
    return maps.tensor(info) if info is not None and home == "cpu" else ckpt.read(key)
