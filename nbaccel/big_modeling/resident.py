"""Resident weights from safetensors files: mapped on CPU, staged through pinned memory to GPUs.

What always holds:

- A CPU weight in the file's own dtype, at a 64-byte aligned file offset (as torch's allocator
  aligns tensors, so it computes the same bits), is a view of one private, copy-on-write memory
  map of its file (:class:`FileMaps`), one map per file: loading copies nothing; it maps the
  file's pages from the page cache (reading them from disk if they are not there), so the
  first forward pass does not fault them in, and processes on one machine that load the same
  checkpoint share them. Writing to such a weight copies the written page
  into the process; the file never changes. The map goes away with the last tensor that uses
  it (no file descriptor is kept open: torch closes it once the file is mapped).
- A weight bound for a GPU is read by reader threads into their pinned buffers and copied from
  there with ``non_blocking=True`` on side streams (:func:`read_to_device`, see
  :mod:`.device_reads`).
- A file cut short after its header was read is a :class:`~nbaccel.errors.CheckpointError`,
  found before any of its bytes are used. (A file cut short *while mapped* cannot be caught:
  reading the lost pages raises SIGBUS, as with any memory map.)
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from typing import cast

import torch

from nbaccel.big_modeling.checkpoint_files import (
    TensorInfo,
    can_map,
    read_tensor,
    truncated_error,
)
from nbaccel.big_modeling.cpu_copies import populate
from nbaccel.big_modeling.device_reads import BUFFER_BYTES, read_to_devices

__all__ = ["FileMaps", "read_to_device"]

_MADV_WILLNEED, _MADV_POPULATE_READ = 3, 22  # <sys/mman.h>; POPULATE_READ is Linux 5.14+


class FileMaps:
    """CPU tensors that are views of their safetensors file, one private map per file.

    Example:
        >>> import tempfile, safetensors.torch
        >>> from nbaccel.big_modeling.checkpoint_files import SafetensorsFile
        >>> path = tempfile.mktemp(suffix=".safetensors")
        >>> safetensors.torch.save_file({"w": torch.arange(3.0)}, path)
        >>> FileMaps().tensor(SafetensorsFile(path).tensors["w"])
        tensor([0., 1., 2.])
    """

    def __init__(self) -> None:
        # Holding the storages only while loading: afterwards the tensors alone keep each map.
        self._maps: dict[str, torch.UntypedStorage] = {}

    def tensor(self, info: TensorInfo) -> torch.Tensor:
        """The tensor ``info`` describes, over the file's own pages; a fresh copy when its file
        offset is not 64-byte aligned (see :func:`~.checkpoint_files.can_map`).

        Raises:
            CheckpointError: the file now ends before the tensor does.
        """
        if not can_map(info):
            return read_tensor(info)
        storage = self._storage(info)
        first = info.offset - info.offset % mmap.PAGESIZE  # only this tensor's pages: a shard
        _populate(storage.data_ptr() + first, info.offset + info.nbytes - first)  # may hold others
        out = torch.empty(0, dtype=info.dtype)
        return out.set_(storage, info.offset // info.dtype.itemsize, info.shape, _contiguous_strides(info.shape))

    def view(self, info: TensorInfo) -> torch.Tensor | None:
        """A view of the tensor's bytes in the file's map, to read (cast) from, not to keep.

        Any offset that is a multiple of the element size will do, since a cast reads values
        one by one; computing with such a view could differ (see :meth:`tensor`). Its pages are
        not brought in: the reader faults them in as it goes.

        Returns:
            The view, or ``None`` for an empty tensor or an offset that splits an element.

        Raises:
            CheckpointError: the file now ends before the tensor does.
        """
        if info.nbytes == 0 or info.offset % info.dtype.itemsize:
            return None
        out = torch.empty(0, dtype=info.dtype)
        return out.set_(self._storage(info), info.offset // info.dtype.itemsize, info.shape,
                        _contiguous_strides(info.shape))

    def _storage(self, info: TensorInfo) -> torch.UntypedStorage:
        storage = self._maps.get(info.path)
        if storage is None or storage.nbytes() < info.offset + info.nbytes:
            storage = self._maps[info.path] = self._map(info)
        return storage

    @staticmethod
    def _map(info: TensorInfo) -> torch.UntypedStorage:
        size = os.path.getsize(info.path)
        if size < info.offset + info.nbytes:
            raise truncated_error(info, size)
        # shared=False: torch maps the file MAP_PRIVATE (copy-on-write) and closes its descriptor
        storage = torch.UntypedStorage.from_file(info.path, shared=False, nbytes=size)
        return cast(torch.UntypedStorage, storage)  # from_file of UntypedStorage makes one (typed as any storage)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (what ``set_`` takes when given none).

    Example:
        >>> _contiguous_strides((2, 0, 3)) == torch.empty(2, 0, 3).stride()
        True
    """
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _populate(address: int, size: int) -> None:
    """Map a file's pages for reading now, without copying them (MAP_POPULATE on a private
    writable map would copy every page); an older kernel gets readahead advice instead."""
    if not populate(address, size, _MADV_POPULATE_READ):
        populate(address, size, _MADV_WILLNEED)


def read_to_device(infos: Sequence[TensorInfo], device: torch.device | str,
                   buffer_bytes: int = BUFFER_BYTES, buffers: int = 2) -> list[torch.Tensor]:
    """Read tensors from their files into new tensors on ``device`` (see
    :func:`~.device_reads.read_to_devices`, which this calls with one device for all).

    Args:
        infos: where each tensor is; read in its stored dtype.
        device: where the tensors go.
        buffer_bytes: the size of each reader's pinned buffers.
        buffers: kept for callers of the earlier signature; each reader has two buffers.

    Returns:
        The tensors, in the order of ``infos``; all copies have finished.

    Raises:
        CheckpointError: a file ends before one of its tensors does.

    Example:
        >>> import tempfile, safetensors.torch
        >>> from nbaccel.big_modeling.checkpoint_files import SafetensorsFile
        >>> path = tempfile.mktemp(suffix=".safetensors")
        >>> safetensors.torch.save_file({"w": torch.arange(5.0)}, path)
        >>> read_to_device([SafetensorsFile(path).tensors["w"]], "cpu", buffer_bytes=8)
        [tensor([0., 1., 2., 3., 4.])]
    """
    return read_to_devices(infos, [device] * len(infos), buffer_bytes)
