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
- A weight bound for a GPU is read with ``preadv`` into one of a few pinned staging buffers and
  copied from there with ``non_blocking=True`` on a side stream (:func:`read_to_device`): the
  next chunk is read while the previous one is in flight, file by file, in file order.
- A file cut short after its header was read is a :class:`~nbaccel.errors.CheckpointError`,
  found before any of its bytes are used. (A file cut short *while mapped* cannot be caught:
  reading the lost pages raises SIGBUS, as with any memory map.)
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator, Sequence

import torch

from nbaccel.big_modeling.checkpoint_files import (
    TensorInfo,
    can_map,
    read_into,
    read_tensor,
    truncated_error,
)
from nbaccel.big_modeling.cpu_copies import populate

__all__ = ["FileMaps", "read_to_device"]

_MADV_WILLNEED, _MADV_POPULATE_READ = 3, 22  # <sys/mman.h>; POPULATE_READ is Linux 5.14+
STAGING_BUFFERS = 2  # two are enough to overlap one read with one copy
STAGING_BYTES = 64 * 2**20  # per buffer; bigger tensors go through in chunks


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
        return out.set_(storage, info.offset // info.dtype.itemsize, info.shape)

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
        return out.set_(self._storage(info), info.offset // info.dtype.itemsize, info.shape)

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
        return torch.UntypedStorage.from_file(info.path, shared=False, nbytes=size)


def _populate(address: int, size: int) -> None:
    """Map a file's pages for reading now, without copying them (MAP_POPULATE on a private
    writable map would copy every page); an older kernel gets readahead advice instead."""
    if not populate(address, size, _MADV_POPULATE_READ):
        populate(address, size, _MADV_WILLNEED)


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _chunks(infos: Sequence[TensorInfo], size: int) -> Iterator[tuple[int, int, int]]:
    """``(tensor index, start byte, length)`` in file order, each at most ``size`` bytes."""
    for k in sorted(range(len(infos)), key=lambda i: (infos[i].path, infos[i].offset)):
        for start in range(0, infos[k].nbytes, size):
            yield k, start, min(size, infos[k].nbytes - start)


def read_to_device(infos: Sequence[TensorInfo], device: torch.device | str,
                   buffer_bytes: int = STAGING_BYTES,
                   buffers: int = STAGING_BUFFERS) -> list[torch.Tensor]:
    """Read tensors from their files into new tensors on ``device``, through staging buffers.

    On a CUDA device the buffers are pinned and each copy is asynchronous on a side stream, so
    reading the next chunk overlaps copying the last; a buffer is reused only once the copy out
    of it has finished. On any other device the same chunks are copied synchronously.

    Args:
        infos: where each tensor is; read in its stored dtype.
        device: where the tensors go.
        buffer_bytes: the size of each staging buffer (at most the largest tensor's size).
        buffers: how many staging buffers take turns.

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
    device = torch.device(device)
    outs = [torch.empty(i.shape, dtype=i.dtype, device=device) for i in infos]
    largest = max((i.nbytes for i in infos), default=0)
    if largest == 0:
        return outs
    cuda = device.type == "cuda"
    size = min(buffer_bytes, largest)
    staging = [torch.empty(size, dtype=torch.uint8, pin_memory=cuda) for _ in range(buffers)]
    done: list[torch.cuda.Event | None] = [None] * buffers
    stream = torch.cuda.Stream(device) if cuda else None
    if stream is not None:  # the outputs were allocated on the current stream: start after it
        stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for turn, (k, start, length) in enumerate(_chunks(infos, size)):
            slot = turn % buffers
            if done[slot] is not None:
                done[slot].synchronize()  # the copy out of this buffer has finished
            buffer = staging[slot][:length]
            read_into(infos[k], memoryview(buffer.numpy()), start)
            _byte_view(outs[k])[start:start + length].copy_(buffer, non_blocking=cuda)
            if stream is not None:
                done[slot] = torch.cuda.Event()
                done[slot].record(stream)
    if stream is not None:
        stream.synchronize()  # the tensors are complete before anyone uses them
    return outs
