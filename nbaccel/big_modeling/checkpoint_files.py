"""Reading checkpoint files: a safetensors file tensor by tensor, a pickle as a checked state dict.

Which files make up a checkpoint (a file, a sharded ``*.index.json``, a folder) is
:mod:`nbaccel.big_modeling.checkpoint_layout`'s job.

A safetensors file is read by its header alone until a tensor is wanted. Resident weights are
then views of the file's own pages (``resident.FileMaps``), copies made on a few threads where
a view would not do (``cpu_copies.copy_to_cpu``), or read through staging buffers
(:func:`read_into`) when they go to a GPU; an offloaded weight, read and dropped on every
forward pass, maps its own pages (:func:`map_tensor`) and unmaps them when dropped. A
truncated or corrupt file is found from the header before any weight is loaded; so are headers
nested deeper than a writer makes them, and tensors whose bytes overlap or leave the data section.
Only regular files are read: a FIFO, a device or a directory named like a checkpoint file is refused
by name before any read (a FIFO would block every load, and Ctrl-C with it).
``.bin``/``.pt`` pickles are loaded with ``weights_only=True`` only
(memory-mapped when saved in torch's zip format): a pickle that would run code is refused, and
its code never runs.
"""

from __future__ import annotations

import itertools
import json
import math
import mmap
import os
import pickle
import struct
from dataclasses import dataclass
from typing import Any

import torch

from nbaccel.big_modeling.tensors import cpu_memoryview
from nbaccel.errors import CheckpointError, UnsafeCheckpointError
from nbaccel.file_kinds import regular_file

__all__ = [
    "SafetensorsFile",
    "TensorInfo",
    "anonymous_tensor",
    "can_map",
    "load_pickle_checkpoint",
    "map_tensor",
    "read_into",
    "read_tensor",
    "truncated_error",
]

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 * 2**20  # the safetensors format caps its header at 100 MB


_MAX_HEADER_DEPTH = 4  # {name: {"shape": [..]}}: three levels; __metadata__ is {str: str}


def _depth(value: object) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth <= _MAX_HEADER_DEPTH:  # deeper is refused anyway: stop walking
                stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are: a file, an absolute offset, a length, dtype and shape."""

    path: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def anonymous_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor in its own anonymous memory map.

    Its memory goes back to the system the moment the tensor is freed. Weights loaded and
    released on every forward would otherwise come from malloc's heap, where glibc's growing
    mmap threshold leaves freed blocks resident: the process would grow by a few blocks per
    forward pass.

    Example:
        >>> anonymous_tensor((2, 3), torch.float16).shape
        torch.Size([2, 3])
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)  # keeps the map alive
    return raw.view(dtype).reshape(shape)


def truncated_error(info: TensorInfo, file_size: int) -> CheckpointError:
    """The error for a file that ends (at ``file_size``) before the tensor ``info`` does."""
    return CheckpointError(f"{info.path} ends after {file_size} bytes, inside a tensor that should end at byte "
                           f"{info.offset + info.nbytes}: the file is truncated. Save or download it again.",
                           path=info.path)


# torch's CPU allocator aligns tensors to 64 bytes, and MKL's results depend on alignment: a
# batch-1 linear layer over weights 4, 8 or 12 bytes off gave outputs 1 ulp off. A view of a
# file keeps the file's alignment, so only tensors at 64-byte file offsets can be views and
# still compute exactly what a load_state_dict model computes.
ALIGNMENT = 64


def can_map(info: TensorInfo) -> bool:
    """Whether a view of the file's pages computes bit for bit what a fresh tensor would.

    Example:
        >>> can_map(TensorInfo("f", 128, 4, torch.float32, (1,)))
        True
    """
    return info.nbytes > 0 and info.offset % ALIGNMENT == 0


_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14+; Python names it from 3.13


def _prefault(mapped: mmap.mmap) -> None:
    """Map the file's pages now, for reading: no copy (MAP_POPULATE on a writable private map copies
    every page), so the thread that prefetches pays for the page faults, not the forward pass."""
    try:
        mapped.madvise(_MADV_POPULATE_READ)
    except (OSError, AttributeError):  # an older kernel, or no madvise: ask for readahead instead
        advice = getattr(mmap, "MADV_WILLNEED", None)
        if advice is not None and hasattr(mapped, "madvise"):
            mapped.madvise(advice)


def map_tensor(info: TensorInfo) -> torch.Tensor:
    """A CPU tensor over the file's own bytes: a private memory map, pre-faulted for reading, no copy.

    Reading maps the page cache's pages straight into the tensor (copy-on-write, so writing to
    the tensor never changes the file); freeing the tensor unmaps them, so the process keeps
    nothing once the tensor is gone. Used for offloaded weights, which are read and dropped on
    every forward pass.

    Raises:
        CheckpointError: the file ends before the tensor does.

    Example:
        >>> import tempfile, safetensors.torch
        >>> path = tempfile.mktemp(suffix=".safetensors")
        >>> safetensors.torch.save_file({"w": torch.arange(3.0)}, path)
        >>> map_tensor(SafetensorsFile(path).tensors["w"])
        tensor([0., 1., 2.])
    """
    if info.nbytes == 0:
        return torch.empty(info.shape, dtype=info.dtype)
    start = info.offset - info.offset % mmap.ALLOCATIONGRANULARITY
    with open(info.path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size < info.offset + info.nbytes:
            raise truncated_error(info, size)
        mapped = mmap.mmap(handle.fileno(), info.offset + info.nbytes - start, flags=mmap.MAP_PRIVATE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
    _prefault(mapped)
    raw = torch.frombuffer(mapped, dtype=torch.uint8, count=info.nbytes, offset=info.offset - start)
    return raw.view(info.dtype).reshape(info.shape)  # the tensor keeps the map alive


def read_tensor(info: TensorInfo, release_on_free: bool = False) -> torch.Tensor:
    """Read one tensor into a new CPU tensor that owns its memory.

    Args:
        info: where the tensor is.
        release_on_free: put it in its own memory map (:func:`anonymous_tensor`), for tensors
            that are read and dropped over and over, such as offloaded weights.

    Raises:
        CheckpointError: the file ends before the tensor does.

    Example:
        >>> import tempfile, safetensors.torch
        >>> path = tempfile.mktemp(suffix=".safetensors")
        >>> safetensors.torch.save_file({"w": torch.ones(2)}, path)
        >>> read_tensor(SafetensorsFile(path).tensors["w"])
        tensor([1., 1.])
    """
    out = anonymous_tensor(info.shape, info.dtype) if release_on_free else \
        torch.empty(info.shape, dtype=info.dtype)
    if info.nbytes == 0:
        return out
    read_into(info, cpu_memoryview(out.reshape(-1).view(torch.uint8)))
    return out


def read_into(info: TensorInfo, view: memoryview, start: int = 0) -> None:
    """Fill ``view`` with the tensor's bytes from byte ``start`` on (``len(view)`` of them).

    Raises:
        CheckpointError: the file ends before those bytes do.

    Example:
        >>> import tempfile, safetensors.torch
        >>> path = tempfile.mktemp(suffix=".safetensors")
        >>> safetensors.torch.save_file({"w": torch.arange(4, dtype=torch.uint8)}, path)
        >>> buffer = bytearray(2); read_into(SafetensorsFile(path).tensors["w"], memoryview(buffer), 1)
        >>> list(buffer)
        [1, 2]
    """
    fd = os.open(info.path, os.O_RDONLY)
    try:
        done, end = 0, len(view)
        while done < end:
            n = os.preadv(fd, [view[done:]], info.offset + start + done)
            if n == 0:
                raise truncated_error(info, info.offset + start + done)
            done += n
    finally:
        os.close(fd)


class SafetensorsFile:
    """A safetensors file's index, read from its header and checked against the file's size.

    Attributes:
        path: the file.
        tensors: ``{name: TensorInfo}``.
        metadata: the header's ``__metadata__`` (``{}`` when absent).

    Raises:
        CheckpointError: the file is missing, truncated or its header is corrupt.

    Example:
        >>> import tempfile, safetensors.torch
        >>> path = tempfile.mktemp(suffix=".safetensors")
        >>> safetensors.torch.save_file({"w": torch.ones(2, 3)}, path)
        >>> SafetensorsFile(path).tensors["w"].shape
        (2, 3)
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = str(path)
        try:
            with regular_file(self.path) as name, open(name, "rb") as f:  # checked on the descriptor read
                size = os.fstat(f.fileno()).st_size
                head = f.read(8)
                length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
                raw = f.read(length) if length is not None and length <= _MAX_HEADER else b""
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint file {self.path} does not exist.",
                                  path=self.path) from None
        if length is None or length > size - 8 or length > _MAX_HEADER:
            raise self._corrupt(f"its header claims {length} bytes but the file has {size}: it "
                                "is truncated, or not a safetensors file")
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise self._corrupt(f"its header is not valid JSON ({exc})") from None
        except RecursionError:  # json's parser recurses once per level of nesting
            raise self._corrupt(f"its header is nested deeper than {_MAX_HEADER_DEPTH} levels") from None
        if not isinstance(header, dict):
            raise self._corrupt("its header is not a JSON object")
        if _depth(header) > _MAX_HEADER_DEPTH:
            raise self._corrupt(f"its header is nested deeper than {_MAX_HEADER_DEPTH} levels")
        self.metadata = header.pop("__metadata__", None) or {}
        data_start, data_size = 8 + length, size - 8 - length
        self._data_start = data_start
        self.tensors = {name: self._entry(name, e, data_start, data_size)
                        for name, e in header.items()}
        self._refuse_overlaps()

    def _refuse_overlaps(self) -> None:
        """Two tensors sharing bytes would alias each other once mapped; a writer never makes that."""
        spans = sorted((info.offset - self._data_start, info.offset - self._data_start + info.nbytes, name)
                       for name, info in self.tensors.items() if info.nbytes)
        for (_, end, first), (begin, _, second) in itertools.pairwise(spans):
            if begin < end:
                raise self._corrupt(f"tensors {first!r} and {second!r} overlap (data bytes {begin}..{end} are "
                                    "claimed by both)", key=second)

    def _corrupt(self, why: str, key: str | None = None) -> CheckpointError:
        return CheckpointError(
            f"cannot read {self.path} as safetensors: {why}. Save or download the file again.",
            path=self.path, key=key)

    def _entry(self, name: str, entry: Any, start: int, size: int) -> TensorInfo:
        try:
            dtype = SAFETENSORS_DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise self._corrupt(f"the header entry of {name!r} is malformed ({entry!r})",
                                key=name) from None
        if begin < 0 or end < begin:
            raise self._corrupt(f"tensor {name!r} has data offsets {begin}..{end}, outside the data section "
                                f"(0..{size})", key=name)
        if end > size:
            raise self._corrupt(f"tensor {name!r} ends at data byte {end} but the file holds "
                                f"only {size} data bytes: the file is truncated", key=name)
        expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if end - begin != expected or begin < 0:
            raise self._corrupt(f"tensor {name!r} spans bytes {begin}..{end}, which does not "
                                f"match its shape {shape} and dtype {dtype}", key=name)
        return TensorInfo(self.path, start + begin, end - begin, dtype, shape)


def load_pickle_checkpoint(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Load a ``.bin``/``.pt`` state dict with ``weights_only=True``, memory-mapped if possible.

    Raises:
        UnsafeCheckpointError: the pickle holds objects that would run code (none of it runs).
        CheckpointError: the file is missing, corrupt, or holds something other than tensors.

    Example:
        >>> import tempfile
        >>> path = tempfile.mktemp(suffix=".bin"); torch.save({"w": torch.zeros(1)}, path)
        >>> load_pickle_checkpoint(path)
        {'w': tensor([0.])}
    """
    path = str(path)
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint file {path} does not exist.", path=path)
    try:
        with regular_file(path) as name:  # the file checked is the file read (a map outlives the descriptor)
            try:
                state = torch.load(name, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as exc:
                if "zipfile" not in str(exc) and "mmap" not in str(exc):
                    raise
                state = torch.load(name, map_location="cpu", weights_only=True)  # legacy format
    except CheckpointError:  # not a regular file: refused as it is, by name
        raise
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(
            f"refused to load {path}: it is a pickle that holds more than tensors, and loading "
            f"it would run code ({str(exc).splitlines()[-1] if str(exc) else exc!r}). Nothing "
            "from it was run. Convert trusted checkpoints to safetensors, or re-save only the "
            "state dict with torch.save(model.state_dict(), path).", path=path) from None
    except (RuntimeError, EOFError, OSError, ValueError, struct.error) as exc:
        raise CheckpointError(f"cannot read {path} as a torch checkpoint: {exc}. Save or "
                              "download it again.", path=path) from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise CheckpointError(
            f"{path} holds a {type(state).__name__} that is not a flat state dict of tensors. "
            "Save model.state_dict() instead.", path=path)
    return state
