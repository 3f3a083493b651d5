"""Checkpoint files: the folder layout `save_state` writes atomically, and `save_model`'s sharded safetensors.

A training state is a folder with Accelerate's file names: ``model.safetensors`` (then
``model_1.safetensors``, ...), ``optimizer.bin``, ``scheduler.bin``, ``sampler.bin``,
``scaler.pt``, ``random_states_<rank>.pkl`` and ``custom_checkpoint_<i>.pkl``. Every process
writes into a temporary sibling folder; only when all have finished does the main process swap
it into place, so a crash during a save leaves the previous checkpoint whole. The folder holds
``nbaccel_checkpoint.json`` once complete. Processes sharing the folder take turns to save, and
a load reads one whole save (:mod:`nbaccel.training.checkpoint_generations`). What goes into the
folder (the Accelerator's prepared objects) is :mod:`nbaccel.training.training_state`'s job.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from nbaccel.errors import CheckpointMismatchError
from nbaccel.file_size import convert_file_size_to_int
from nbaccel.training.checkpoint_generations import (
    MARKER,
    exclusive_folder,
    one_saver,
    pinned_checkpoint,
    siblings,
)
from nbaccel.training.disk_full import disk_full_error

__all__ = ["MARKER", "check_fits", "load_into", "numbered_name", "read_weights", "remove_checkpoint",
           "resolve_checkpoint", "save_model_shards", "save_state_folder", "write_weights"]

SAFE_WEIGHTS = "model.safetensors"
TORCH_WEIGHTS = "pytorch_model.bin"


def numbered_name(stem: str, index: int, ext: str) -> str:
    """The file of the ``index``-th object of a kind, Accelerate's way: ``model.safetensors``, ``model_1.safetensors``.

    Example:
        >>> numbered_name("optimizer", 0, "bin"), numbered_name("optimizer", 2, "bin")
        ('optimizer.bin', 'optimizer_2.bin')
    """
    return f"{stem}.{ext}" if index == 0 else f"{stem}_{index}.{ext}"


# --------------------------------------------------------------------------- tensors on disk


def _dedupe(state_dict: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Drop later names of tensors that share storage (tied weights); safetensors refuses them."""
    seen: set[tuple[Any, ...]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if not torch.is_tensor(tensor):
            continue
        key = (*_alias_key(tensor), tuple(tensor.shape))
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach().cpu().contiguous()
    return out


def write_weights(state_dict: Mapping[str, Any], path: Path, safe_serialization: bool) -> None:
    """Write one weights file (safetensors with ``format=pt`` metadata, or ``torch.save``)."""
    if safe_serialization:
        from safetensors.torch import save_file

        save_file(_dedupe(state_dict), str(path), metadata={"format": "pt"})
    else:
        torch.save(dict(state_dict), path)


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """Read a weights file written by :func:`write_weights`."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)


def _alias_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    """What tied names share: the storage on CPU/CUDA; on XLA and for DTensors (no storage pointers) the object."""
    if tensor.device.type == "xla":
        return ("xla", id(tensor))
    try:
        return (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
    except RuntimeError:  # a DTensor (FSDP2) has no storage of its own: tied names share the parameter object
        return ("object", id(tensor))


def check_fits(model: torch.nn.Module, weights: Mapping[str, torch.Tensor], strict: bool = True,
               path: Path | None = None) -> None:
    """Refuse ``weights`` that ``model`` cannot take, before any of it is loaded.

    Shapes must match always (``load_state_dict`` refuses them even with ``strict=False``, after
    loading the others); with ``strict``, no key may be missing or unexpected, where a name missing
    only because it is a tied alias of a loaded tensor is fine.

    Raises:
        CheckpointMismatchError: naming the file, the keys and the shapes; ``model`` is unchanged.
    """
    own = model.state_dict(keep_vars=True)
    shapes = {n: (tuple(w.shape), tuple(own[n].shape)) for n, w in weights.items()
              if n in own and torch.is_tensor(w) and torch.is_tensor(own[n]) and w.shape != own[n].shape}
    missing: list[str] = []
    unexpected: list[str] = []
    if strict:  # a module's `_extra_state` may be any object: only tensors can be tied aliases
        present = {_alias_key(t) for n, t in own.items() if n in weights and torch.is_tensor(t)}
        missing = [n for n in own if n not in weights and not (torch.is_tensor(own[n])
                                                                 and _alias_key(own[n]) in present)]
        unexpected = [n for n in weights if n not in own]
    if not (shapes or missing or unexpected):
        return
    where = f"{str(path)!r}" if path is not None else "the checkpoint"
    parts = [f"{n}: {saved} in the file, {mine} in the model" for n, (saved, mine) in list(shapes.items())[:5]]
    raise CheckpointMismatchError(
        f"{where} does not fit {type(model).__name__}, so nothing was loaded: "
        + (f"shape mismatches ({len(shapes)}): {'; '.join(parts)}; " if shapes else "")
        + (f"missing keys {missing}; " if missing else "") + (f"unexpected keys {unexpected}; " if unexpected else "")
        + "Fix: load it into the model it was saved from" + (", or pass strict=False" if not shapes else ""),
        path=str(path) if path is not None else None, missing_keys=tuple(missing),
        unexpected_keys=tuple(unexpected), mismatched_shapes=shapes)


def load_into(model: torch.nn.Module, weights: Mapping[str, torch.Tensor], strict: bool = True) -> None:
    """Load ``weights`` into ``model`` after :func:`check_fits`; tied aliases missing from the file are fine.

    Raises:
        CheckpointMismatchError: keys are missing or unexpected (with ``strict``), or shapes differ.
    """
    check_fits(model, weights, strict)
    model.load_state_dict(weights, strict=False)


def save_model_shards(state_dict: Mapping[str, Any], save_directory: Path, max_shard_size: int | str = "10GB",
                      safe_serialization: bool = True) -> list[Path]:
    """Write ``state_dict`` as weight files of at most ``max_shard_size``, with an index when sharded.

    One shard is ``model.safetensors``; more are ``model-00001-of-0000N.safetensors`` plus
    ``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map": ...}``),
    as Accelerate and Transformers write them. Stale shards of an earlier save are removed.

    Returns:
        The files written.
    """
    limit = convert_file_size_to_int(max_shard_size, key="max_shard_size")
    tensors = _dedupe(state_dict) if safe_serialization else {k: v for k, v in state_dict.items() if torch.is_tensor(v)}
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if sizes[-1] and sizes[-1] + nbytes > limit:
            shards.append({})
            sizes.append(0)
        shards[-1][name] = tensor
        sizes[-1] += nbytes
    base = SAFE_WEIGHTS if safe_serialization else TORCH_WEIGHTS
    stem, ext = base.rsplit(".", 1)
    save_directory.mkdir(parents=True, exist_ok=True)
    names = ([base] if len(shards) == 1
             else [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.{ext}" for i in range(len(shards))])
    pattern = re.compile(rf"{re.escape(stem)}(-\d{{5}}-of-\d{{5}})?\.{re.escape(ext)}(\.index\.json)?")
    for old in save_directory.iterdir():
        if old.is_file() and pattern.fullmatch(old.name) and old.name not in names:
            old.unlink()
    written = []
    for name, shard in zip(names, shards):
        write_weights(shard, save_directory / name, safe_serialization)
        written.append(save_directory / name)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes)},
                 "weight_map": {k: name for name, shard in zip(names, shards) for k in shard}}
        index_path = save_directory / f"{base}.index.json"
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.append(index_path)
    return written


# --------------------------------------------------------------------------- atomic folders
#
# A save moves through these filesystem states (F the folder, T and O its hidden siblings);
# at every point between two steps one complete checkpoint exists, and a later save or load finds it:
#
#   recover: F missing and O (or T) complete -> rename it to F    (a crash between the renames)
#   remove T, mkdir T, every rank writes into T, marker into T    (F untouched)
#   remove O (marker first)                                       (F complete)
#   rename F -> O                                                 (O complete)
#   rename T -> F                                                 (F and O complete)
#   remove O (marker first)                                       (F complete)


def _is_complete(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def remove_checkpoint(folder: Path) -> None:
    """Delete a checkpoint folder once no load is reading it, its marker first (a crash midway never
    leaves a folder that looks complete; a load that opened it meanwhile sees it gone and looks again)."""
    with exclusive_folder(folder) as fd:
        if fd is None:
            return
        marker = folder / MARKER
        if marker.is_file():
            marker.unlink()
            _fsync_dir(folder)
        shutil.rmtree(folder, ignore_errors=True)


def resolve_checkpoint(folder: Path) -> Path:
    """The complete checkpoint at ``folder`` (or the one a crash mid-swap left beside it).

    Raises:
        CheckpointError: no complete checkpoint is there.
    """
    with pinned_checkpoint(folder) as pinned:
        return pinned.path


def _recover(folder: Path) -> None:
    """Put back the complete checkpoint a crash between the two renames left beside ``folder``."""
    if folder.exists():
        return
    tmp, old = siblings(folder)
    for left in (old, tmp):
        if _is_complete(left):
            os.rename(left, folder)
            _fsync_dir(folder.parent)
            return


def save_state_folder(folder: Path, write: Callable[[Path], None], *, barrier: Callable[[], None],
                      is_writer: bool, summary: Mapping[str, Any]) -> Path:
    """Run ``write(tmp)`` on every process, then swap ``tmp`` into ``folder`` atomically.

    Args:
        folder: the checkpoint folder.
        write: writes this process's files into the folder it is given.
        barrier: waits for every process.
        is_writer: this process prepares and swaps the folder (main process, or local main per node).
        summary: what the checkpoint holds, stored in its marker file.

    Raises:
        CheckpointDiskFullError: the disk filled while writing; the partial copy was removed and
            the previous checkpoint is intact (see :mod:`nbaccel.training.disk_full`).
    """
    tmp, old = siblings(folder)
    if is_writer:
        folder.parent.mkdir(parents=True, exist_ok=True)
    # Another process saving into the same folder waits here for its turn (it would share `tmp`).
    with one_saver(folder) if is_writer else contextlib.nullcontext():
        if is_writer:
            _recover(folder)  # before anything is removed: the copy a crashed save left may be the only one
            remove_checkpoint(tmp)
            tmp.mkdir()
        barrier()
        with _full_disk_reported(tmp, folder):
            write(tmp)
        barrier()
        if is_writer:
            with _full_disk_reported(tmp, folder):
                part = tmp / f".{MARKER}.part"
                part.write_text(json.dumps(dict(summary), indent=2, sort_keys=True) + "\n")
                os.replace(part, tmp / MARKER)  # a half-written marker never makes the folder look complete
                _fsync_dir(tmp)
            remove_checkpoint(old)
            if folder.exists():
                os.rename(folder, old)
            os.rename(tmp, folder)
            _fsync_dir(folder.parent)
            remove_checkpoint(old)  # waits for the loads still reading it
        barrier()
    return folder


@contextlib.contextmanager
def _full_disk_reported(tmp: Path, folder: Path) -> Iterator[None]:
    """A write that filled the disk becomes a CheckpointDiskFullError, its partial copy removed."""
    try:
        yield
    except Exception as exc:
        full = disk_full_error(exc, tmp, folder, remove_checkpoint)
        if full is None:
            raise
        raise full from exc


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
