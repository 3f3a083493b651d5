"""A checkpoint as a whole: one file, a sharded ``*.index.json`` checkpoint, or a folder of shards.

:func:`open_checkpoint` finds the files and which tensor lives in which; reading a file is
:mod:`nbaccel.big_modeling.checkpoint_files`'.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from nbaccel.big_modeling.checkpoint_files import (
    SafetensorsFile,
    TensorInfo,
    load_pickle_checkpoint,
    read_tensor,
)
from nbaccel.errors import CheckpointError
from nbaccel.file_kinds import regular_file

__all__ = ["Checkpoint", "open_checkpoint"]

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth")  # torch.save files a checkpoint may consist of


class Checkpoint:
    """The tensors of one checkpoint (a file, a sharded index, or a folder), by name.

    Safetensors shards are described by their headers and read per tensor; pickle shards are
    loaded (memory-mapped) when first opened.

    Example:
        >>> import tempfile, safetensors.torch
        >>> path = tempfile.mktemp(suffix=".safetensors")
        >>> safetensors.torch.save_file({"w": torch.ones(2)}, path)
        >>> ckpt = open_checkpoint(path); sorted(ckpt.keys()), ckpt.shape("w")
        (['w'], (2,))
    """

    def __init__(self, path: str, files: list[str], weight_map: dict[str, str] | None) -> None:
        self.path = path
        self.files = files
        self._safetensors = {f: SafetensorsFile(f) for f in files if f.endswith(".safetensors")}
        self._pickled = {f: load_pickle_checkpoint(f) for f in files if f not in
                         self._safetensors}
        self._where: dict[str, str] = {}
        for f in files:
            names = self._safetensors[f].tensors if f in self._safetensors else self._pickled[f]
            self._where.update(dict.fromkeys(names, f))
        for key, f in (weight_map or {}).items():
            if self._where.get(key) != f:
                raise CheckpointError(
                    f"the index {path} says {key!r} is in {f}, but that file does not hold it. "
                    "The index and its shards are out of step: save the checkpoint again.",
                    path=f, key=key)

    def keys(self) -> Iterator[str]:
        return iter(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def file_of(self, key: str) -> str:
        return self._where[key]

    def location(self, key: str) -> TensorInfo | None:
        """Where the tensor's bytes are, if it lives in a safetensors file."""
        f = self._where[key]
        return self._safetensors[f].tensors[key] if f in self._safetensors else None

    def shape(self, key: str) -> tuple[int, ...]:
        info = self.location(key)
        return info.shape if info else tuple(self._pickled[self._where[key]][key].shape)

    def dtype(self, key: str) -> torch.dtype:
        info = self.location(key)
        return info.dtype if info else self._pickled[self._where[key]][key].dtype

    def read(self, key: str) -> torch.Tensor:
        """The tensor, on CPU (a fresh tensor for safetensors; memory-mapped for pickles)."""
        info = self.location(key)
        return read_tensor(info) if info else self._pickled[self._where[key]][key]


def _index_files(index: Path) -> tuple[list[str], dict[str, str]]:
    try:
        with regular_file(index) as name:
            data = json.loads(Path(name).read_text())
        # transformers writes {"metadata": ..., "weight_map": {...}}; Accelerate also takes the bare mapping
        weight_map = data.get("weight_map", data)
        if not isinstance(weight_map, dict) or not weight_map or not all(
                isinstance(v, str) for v in weight_map.values()):
            raise TypeError
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint index {index} does not exist.",
                              path=str(index)) from None
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
        raise CheckpointError(
            f"{index} is not a checkpoint index: expected JSON mapping tensor name -> shard file (alone, or "
            "under 'weight_map'). Save the checkpoint again.", path=str(index)) from None
    files = sorted(set(weight_map.values()))
    paths = {f: str(index.parent / f) for f in files}
    for f, p in paths.items():
        if not os.path.exists(p):
            key = next(k for k, v in weight_map.items() if v == f)
            raise CheckpointError(f"the index {index} lists shard {f} (holding {key!r}), which "
                                  f"does not exist in {index.parent}.", path=p, key=key)
    return list(paths.values()), {k: paths[v] for k, v in weight_map.items()}


def _folder_files(folder: Path) -> tuple[list[str], dict[str, str] | None]:
    for pattern in ("*.safetensors.index.json", "*.index.json"):
        indexes = sorted(folder.glob(pattern))
        if len(indexes) == 1:
            return _index_files(indexes[0])
        if len(indexes) > 1:
            raise CheckpointError(
                f"{folder} holds several checkpoint indexes {[p.name for p in indexes]}; pass "
                "the one to load as `checkpoint`.", path=str(folder))
    for suffixes in ((".safetensors",), _PICKLE_SUFFIXES):
        found = sorted(p for p in folder.iterdir() if p.suffix in suffixes)
        if len(found) == 1:
            return [str(found[0])], None
        if len(found) > 1:
            raise CheckpointError(
                f"{folder} holds several weight files {[p.name for p in found]} and no "
                "*.index.json saying how they fit together; pass one file as `checkpoint`.",
                path=str(folder))
    raise CheckpointError(
        f"{folder} holds no checkpoint: no *.index.json, *.safetensors, *.bin, *.pt or *.pth "
        "file.", path=str(folder))


def open_checkpoint(checkpoint: str | os.PathLike) -> Checkpoint:
    """Open a checkpoint: a weights file, a ``*.index.json`` of shards, or a folder of either.

    Raises:
        CheckpointError: the path does not exist, is of an unknown kind, or its files are
            missing, truncated or corrupt.
        UnsafeCheckpointError: a pickle shard would run code.

    Example:
        >>> import tempfile, safetensors.torch
        >>> folder = tempfile.mkdtemp()
        >>> safetensors.torch.save_file({"w": torch.ones(1)}, f"{folder}/model.safetensors")
        >>> list(open_checkpoint(folder).keys())
        ['w']
    """
    path = Path(checkpoint)
    if path.is_dir():
        files, weight_map = _folder_files(path)
    elif path.name.endswith(".json"):
        files, weight_map = _index_files(path)
    elif not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist.", path=str(path))
    elif path.suffix in (".safetensors", *_PICKLE_SUFFIXES):
        files, weight_map = [str(path)], None
    else:
        raise CheckpointError(
            f"cannot tell what kind of checkpoint {path} is: expected a folder, a "
            "*.index.json, or a .safetensors, .bin, .pt or .pth file.", path=str(path))
    return Checkpoint(str(path), files, weight_map)
