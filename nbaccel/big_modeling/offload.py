"""Offloaded weights: one ``Mapping`` over tensors in RAM, ``.dat`` files and safetensors files.

An offload folder holds ``index.json`` (``{name: {"dtype", "shape"}}``) and one raw
``<name>.dat`` file per tensor, as Accelerate writes it. An index entry may instead point into
a checkpoint's own safetensors file (``{"safetensors_file", "weight_name", "dtype"}``, the form
Transformers uses), so a checkpoint that is already safetensors is never copied. Reads go
straight into fresh tensors; :meth:`OffloadedWeightsLoader.prefetch` reads the next module's
weights on a background thread while the current module computes.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from nbaccel.big_modeling.checkpoint_files import (
    SafetensorsFile,
    TensorInfo,
    anonymous_tensor,
    map_tensor,
    read_tensor,
)
from nbaccel.big_modeling.tensors import cpu_memoryview
from nbaccel.errors import CheckpointError

__all__ = [
    "OffloadedWeightsLoader",
    "PrefixedDataset",
    "load_offloaded_weight",
    "offload_state_dict",
    "offload_weight",
    "save_offload_index",
]

IndexEntry = dict[str, Any]


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def offload_weight(weight: torch.Tensor, weight_name: str, offload_folder: str | os.PathLike,
                   index: dict[str, IndexEntry] | None = None) -> dict[str, IndexEntry]:
    """Write one tensor to ``<offload_folder>/<weight_name>.dat`` and record it in ``index``.

    Returns:
        The index, with the tensor's entry added.

    Example:
        >>> import tempfile
        >>> offload_weight(torch.ones(2), "w", tempfile.mkdtemp())
        {'w': {'dtype': 'float32', 'shape': [2]}}
    """
    index = {} if index is None else index
    folder = Path(offload_folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = weight.detach().to("cpu").contiguous()
    with open(folder / f"{weight_name}.dat", "wb") as f:
        if data.numel():
            f.write(cpu_memoryview(data.reshape(-1).view(torch.uint8)))
    index[weight_name] = {"dtype": str(data.dtype).removeprefix("torch."),
                          "shape": list(data.shape)}
    return index


def save_offload_index(index: Mapping[str, IndexEntry], offload_folder: str | os.PathLike) -> None:
    """Merge ``index`` into ``<offload_folder>/index.json`` (created if needed).

    Example:
        >>> import tempfile; folder = tempfile.mkdtemp()
        >>> save_offload_index(offload_weight(torch.ones(1), "w", folder), folder)
    """
    if not index:
        return
    path = Path(offload_folder) / "index.json"
    current = json.loads(path.read_text()) if path.exists() else {}
    current.update(index)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(current, indent=2))


@functools.lru_cache(maxsize=512)
def _safetensors_file(path: str, mtime_ns: int, size: int) -> SafetensorsFile:
    """Parse a header once per file version; a rewritten file is parsed again."""
    return SafetensorsFile(path)


def _location(key: str, entry: IndexEntry, folder: str | None) -> TensorInfo:
    if "safetensors_file" in entry:
        name = entry.get("weight_name", key)
        path = str(entry["safetensors_file"])
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            raise CheckpointError(f"the offload index points {key!r} at {path}, which does not "
                                  "exist; an index that points into a checkpoint needs that file "
                                  "where it was. Restore the file, or load the checkpoint again "
                                  "with load_checkpoint_and_dispatch.", path=path, key=key) from None
        file = _safetensors_file(path, stat.st_mtime_ns, stat.st_size)
        if name not in file.tensors:
            close = difflib.get_close_matches(name, list(file.tensors), n=3)
            raise CheckpointError(f"the offload index points {key!r} at {name!r} in "
                                  f"{file.path}, which that file does not hold"
                                  + (f" (did you mean {close}?)" if close else "") + "; the "
                                  "file or the index changed since it was written. Load the "
                                  "checkpoint again with load_checkpoint_and_dispatch.",
                                  path=file.path, key=name)
        return file.tensors[name]
    if folder is None:
        raise CheckpointError(f"the offload index lists {key!r} as a .dat file, but no offload "
                              "folder was given (offload_dir=None), so there is nowhere to read "
                              "it from. Pass the folder that holds index.json as offload_dir "
                              "(offload_folder when loading).", key=key)
    path = os.path.join(folder, f"{key}.dat")
    dtype, shape = _dtype(entry["dtype"]), tuple(entry["shape"])
    nbytes = torch.empty(shape, dtype=dtype, device="meta").nbytes
    size = os.path.getsize(path) if os.path.exists(path) else None
    if size is None or size < nbytes:
        found = "does not exist" if size is None else f"holds {size} bytes"
        raise CheckpointError(f"offloaded weight {key!r} should be {nbytes} bytes in {path}, "
                              f"which {found}. Delete the offload folder and load the "
                              "checkpoint again.", path=path, key=key)
    return TensorInfo(path, 0, nbytes, dtype, shape)


def load_offloaded_weight(weight_file: str | os.PathLike, weight_info: IndexEntry) -> torch.Tensor:
    """Read one ``.dat`` file described by its index entry.

    Example:
        >>> import tempfile; folder = tempfile.mkdtemp()
        >>> index = offload_weight(torch.arange(3.0), "w", folder)
        >>> load_offloaded_weight(f"{folder}/w.dat", index["w"])
        tensor([0., 1., 2.])
    """
    path = str(weight_file)
    key = os.path.basename(path).removesuffix(".dat")
    return read_tensor(_location(key, weight_info, os.path.dirname(path)))


def offload_state_dict(save_dir: str | os.PathLike, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Write a whole state dict to an offload folder (``.dat`` files and ``index.json``).

    Example:
        >>> import tempfile
        >>> offload_state_dict(tempfile.mkdtemp(), {"w": torch.ones(1)})
    """
    index: dict[str, IndexEntry] = {}
    for name, tensor in state_dict.items():
        index = offload_weight(tensor, name, save_dir, index)
    save_offload_index(index, save_dir)


class OffloadedWeightsLoader(Mapping):
    """Offloaded weights by name: RAM tensors first, then the index (``.dat`` or safetensors).

    Args:
        state_dict: tensors kept in memory (returned as they are).
        save_folder: an offload folder; its ``index.json`` is read when ``index`` is ``None``.
        index: ``{name: entry}`` as in ``index.json``.
        device: accepted for Accelerate compatibility; tensors are read to CPU and moved by
            the hook that uses them.

    Example:
        >>> import tempfile; folder = tempfile.mkdtemp()
        >>> offload_state_dict(folder, {"w": torch.ones(2)})
        >>> weights = OffloadedWeightsLoader(state_dict={"b": torch.zeros(1)}, save_folder=folder)
        >>> sorted(weights), weights["w"]
        (['b', 'w'], tensor([1., 1.]))
    """

    def __init__(self, state_dict: Mapping[str, torch.Tensor] | None = None,
                 save_folder: str | os.PathLike | None = None,
                 index: Mapping[str, IndexEntry] | None = None,
                 device: torch.device | str | int | None = None) -> None:
        self.state_dict = dict(state_dict or {})
        self.save_folder = None if save_folder is None else str(save_folder)
        if index is None and self.save_folder is not None:
            path = Path(self.save_folder) / "index.json"
            index = json.loads(path.read_text()) if path.exists() else {}
        self.index = dict(index or {})
        self.device = device
        self.all_keys = list(self.state_dict) + [k for k in self.index
                                                 if k not in self.state_dict]
        self._locations: dict[str, tuple[TensorInfo, torch.dtype | None]] = {}
        self._pending: dict[str, Future] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._pid = os.getpid()

    def _where(self, key: str) -> tuple[TensorInfo, torch.dtype | None]:
        if key not in self._locations:
            entry = self.index[key]
            info = _location(key, entry, self.save_folder)
            cast = _dtype(entry["dtype"]) if "dtype" in entry else None
            self._locations[key] = (info, None if cast == info.dtype else cast)
        return self._locations[key]

    def location(self, key: str) -> tuple[TensorInfo, torch.dtype | None]:
        """Where an indexed (not in-memory) weight lies, and the dtype it is cast to (``None``:
        as stored).

        Raises:
            KeyError: ``key`` is not in the index.
            CheckpointError: the index points at a file that is missing or does not hold it.

        Example:
            >>> import tempfile; folder = tempfile.mkdtemp()
            >>> offload_state_dict(folder, {"w": torch.ones(2)})
            >>> OffloadedWeightsLoader(save_folder=folder).location("w")[0].nbytes
            8
        """
        return self._where(key)

    def _read(self, key: str) -> torch.Tensor:
        info, cast = self._where(key)
        # An offloaded weight lives for one forward: mapping it even off the allocator's 64-byte
        # alignment (most safetensors files are 8 bytes off) beats copying it on every forward
        # (3.4x slower in benchmarks/big_model.py), at the cost of MKL's batch-1 linear layers
        # rounding the last bit differently, as with Accelerate's offload. Resident weights, which
        # stay, keep the exact rule (can_map).
        if info.nbytes > 0 and info.offset % max(1, info.dtype.itemsize) == 0:
            tensor = map_tensor(info)  # the file's own pages: no copy, unmapped when dropped
        else:  # pragma: no cover - safetensors and nbaccel's .dat files keep elements aligned
            tensor = read_tensor(info, release_on_free=True)
        if cast is None or not tensor.is_floating_point():
            return tensor
        return anonymous_tensor(info.shape, cast).copy_(tensor)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.state_dict:
            return self.state_dict[key]
        self._after_fork()
        future = self._pending.pop(key, None)
        if future is not None:
            return future.result()
        if key not in self.index:
            raise KeyError(key)
        return self._read(key)

    def prefetch(self, keys: Iterable[str]) -> None:
        """Start reading ``keys`` on a background thread; earlier unused prefetches are dropped.

        Example:
            >>> OffloadedWeightsLoader(state_dict={"w": torch.ones(1)}).prefetch(["w"])
        """
        self._after_fork()
        wanted = [k for k in keys if k not in self.state_dict and k in self.index]
        for key in wanted:  # resolve in the caller's thread, so errors surface there
            self._where(key)
        if not wanted:
            self._pending = {}
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="nbaccel-prefetch")
        executor = self._executor
        self._pending = {k: self._pending.get(k) or executor.submit(self._read, k) for k in wanted}

    def _after_fork(self) -> None:
        if os.getpid() != self._pid:  # a forked child has no prefetch thread: start over
            self._pid, self._executor, self._pending = os.getpid(), None, {}

    def __iter__(self) -> Iterator[str]:
        return iter(self.all_keys)

    def __len__(self) -> int:
        return len(self.all_keys)

    def __contains__(self, key: object) -> bool:
        return key in self.state_dict or key in self.index

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_executor=None, _pending={})
        return state


class PrefixedDataset(Mapping):
    """A view of a weights mapping under one module's prefix (``"blocks.0."``).

    Example:
        >>> view = PrefixedDataset({"a.w": torch.ones(1), "b.w": torch.zeros(1)}, "a.")
        >>> list(view), view["w"]
        (['w'], tensor([1.]))
    """

    def __init__(self, dataset: Mapping[str, torch.Tensor], prefix: str) -> None:
        self.dataset = dataset
        self.prefix = prefix

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.dataset[f"{self.prefix}{key}"]

    def __contains__(self, key: object) -> bool:
        return f"{self.prefix}{key}" in self.dataset

    def __iter__(self) -> Iterator[str]:
        n = len(self.prefix)
        return iter([k[n:] for k in self.dataset if k.startswith(self.prefix)])

    def __len__(self) -> int:
        return sum(1 for k in self.dataset if k.startswith(self.prefix))

    def prefetch(self, keys: Iterable[str]) -> None:
        """Pass a prefetch request on to the underlying loader, if it prefetches."""
        prefetch = getattr(self.dataset, "prefetch", None)
        if prefetch is not None:
            prefetch([f"{self.prefix}{k}" for k in keys])
