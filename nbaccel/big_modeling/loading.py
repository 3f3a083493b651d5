"""Loading a checkpoint into a model, by device map, and loading then dispatching in one call.

The checkpoint is checked against the model first (keys, tied aliases, shapes) from file
headers alone, so a mismatch leaves the model untouched. Then each tensor goes straight to where
the device map puts it. CPU weights that live in a safetensors file, in their stored dtype and
at 64-byte aligned offsets, are not copied: they are views of a private, copy-on-write map of
the file, its pages mapped in at load (so processes on one machine share them); a dtype change,
or a file off that alignment, copies, on one thread pool for the whole load (:mod:`.cpu_copies`;
a cast reads straight from the file's map). GPU weights are read by reader threads
into their own pinned buffers, for all GPUs at once (:mod:`.device_reads`). A checkpoint of several
files shows a "Loading checkpoint shards" bar (:mod:`.load_progress`).
Weights mapped to ``"disk"`` that live in a safetensors
file are not read either: the offload index points into the checkpoint's own file. Weights from
``.bin``/``.pt`` pickles come from ``torch.load`` (memory-mapped where its format allows) and are
copied into the offload folder when offloaded. An error or an interrupt (Ctrl-C) part-way puts
back every tensor the load had replaced: the model is left as it was (the readers stop within
milliseconds, see :mod:`.device_reads`).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

from nbaccel.big_modeling.checkpoint_layout import Checkpoint, open_checkpoint
from nbaccel.big_modeling.device_map import DeviceMapStrategy, check_device_map, plan_device_map
from nbaccel.big_modeling.dispatch import dispatch_model
from nbaccel.big_modeling.load_progress import ShardProgress
from nbaccel.big_modeling.map_devices import MapDevice, device_for
from nbaccel.big_modeling.map_entries import dispatch_entries
from nbaccel.big_modeling.offload import IndexEntry, offload_weight, save_offload_index
from nbaccel.big_modeling.resident import FileMaps
from nbaccel.big_modeling.resident_values import (
    copied_to_cpu,
    resident_value,
    staged_to_gpus,
)
from nbaccel.big_modeling.sizes import MaxMemory, find_tied_parameters
from nbaccel.big_modeling.streamed_offload import OFFLOAD_SLOTS
from nbaccel.big_modeling.tensors import Device, as_torch_dtype, set_module_tensor_to_device
from nbaccel.errors import CheckpointMismatchError, ConfigError

__all__ = ["load_checkpoint_and_dispatch", "load_checkpoint_in_model"]

_log = logging.getLogger(__name__)


def _sources(model: nn.Module, ckpt: Checkpoint, strict: bool) -> dict[str, str]:
    """``{model tensor: checkpoint key}``; a tied alias reads its group's stored copy."""
    tensors = model.state_dict(keep_vars=True)
    group_of = {n: g for g in find_tied_parameters(model) for n in g}
    sources, missing, shapes = {}, [], {}
    for name, tensor in tensors.items():
        stored = [n for n in group_of.get(name, [name]) if n in ckpt]
        if name in ckpt:
            stored = [name]
        if not stored:
            if tensor.is_meta or strict:
                missing.append(name)
            continue
        sources[name] = stored[0]
        if ckpt.shape(stored[0]) != tuple(tensor.shape):
            shapes[name] = (ckpt.shape(stored[0]), tuple(tensor.shape))
    missing += [n for n, b in model.named_buffers(remove_duplicate=False)
                if b.is_meta and n not in tensors]  # non-persistent: no checkpoint has them
    unexpected = sorted(set(ckpt.keys()) - set(tensors))
    if missing or shapes or (strict and unexpected):
        parts = [f"missing keys {missing[:5]}" + (" ..." if len(missing) > 5 else "")] * \
            bool(missing)
        parts += [f"shape mismatches (checkpoint, model) {dict(list(shapes.items())[:5])}"] * \
            bool(shapes)
        parts += [f"unexpected keys {unexpected[:5]}"] * bool(strict and unexpected)
        raise CheckpointMismatchError(
            f"the checkpoint {ckpt.path} does not match {type(model).__name__}: "
            f"{'; '.join(parts)}. The model was left unchanged. Check that the checkpoint was "
            "saved from this model's class and configuration.", path=ckpt.path,
            missing_keys=tuple(missing), unexpected_keys=tuple(unexpected),
            mismatched_shapes=shapes)
    if unexpected:  # logged, not warned, as Accelerate does: a warning filter set to "error"
        # must not turn a checkpoint with extra tensors (a head, a buffer) into a failure
        # Accelerate's words first: its tests (and users' log filters) look for "were not used when"
        _log.warning("Some weights of the model checkpoint at %s were not used when initializing %s: %s (%d in all); "
                     "they were ignored (pass strict=True to make this an error).", ckpt.path, type(model).__name__,
                     unexpected[:5], len(unexpected))
    unloaded = [n for n in tensors if n not in sources]
    if unloaded:
        warnings.warn(f"the checkpoint {ckpt.path} has no values for {len(unloaded)} tensor(s), "
                      f"first {unloaded[:5]}; they keep their current values (pass strict=True "
                      "to make this an error).", stacklevel=3)
    return sources


def _target_dtype(name: str, stored: torch.dtype, current: torch.dtype,
                  dtype: torch.dtype | None, keep_in_fp32: Sequence[str]) -> torch.dtype:
    if not stored.is_floating_point:
        return stored
    if any(f".{m}." in f".{name}." for m in keep_in_fp32):
        return torch.float32
    if dtype is not None:
        return dtype
    return current if current.is_floating_point else stored


def _home(name: str, tensor: torch.Tensor, device_map: Mapping[str, MapDevice] | None,
          is_buffer: bool, offload_buffers: bool) -> MapDevice:
    if device_map is None:
        return "cpu" if tensor.is_meta else (tensor.device.index if tensor.is_cuda
                                             else tensor.device.type)
    device = device_for(name, device_map)
    assert device is not None, "check_device_map made the map place every tensor"
    return "cpu" if device == "disk" and is_buffer and not offload_buffers else device


def _share(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Make ``name`` refer to the very tensor another tied name already holds."""
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    if leaf in module._parameters:
        module._parameters[leaf] = cast(nn.Parameter, tensor)  # the parameter another name of the tie holds
    else:
        module._buffers[leaf] = tensor


class _Before:
    """The tensor objects a load replaced, to put back when it fails or is interrupted part-way,
    so that the model is left as it was (``set_module_tensor_to_device`` replaces, never mutates)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.kept: list[tuple[dict[str, Any], str, torch.Tensor | None]] = []

    def keep(self, name: str) -> None:
        owner_name, _, leaf = name.rpartition(".")
        owner = self.model.get_submodule(owner_name)
        table = owner._parameters if leaf in owner._parameters else owner._buffers
        self.kept.append((table, leaf, table.get(leaf)))

    def restore(self) -> None:
        for table, leaf, old in reversed(self.kept):
            table[leaf] = old


def _load(model: nn.Module, checkpoint: str | os.PathLike,
          device_map: Mapping[str, MapDevice] | None, offload_folder: str | os.PathLike | None,
          dtype: torch.dtype | None, offload_buffers: bool, keep_in_fp32: Sequence[str],
          strict: bool, index_needs_folder: bool, show_progress: bool) -> dict[str, IndexEntry]:
    ckpt = open_checkpoint(checkpoint)
    sources = _sources(model, ckpt, strict)
    with ShardProgress({k: ckpt.file_of(k) for k in sources.values()}, show_progress) as progress:
        return _load_into(model, ckpt, sources, device_map, offload_folder, dtype,
                          offload_buffers, keep_in_fp32, index_needs_folder, progress)


def _load_into(model: nn.Module, ckpt: Checkpoint, sources: Mapping[str, str],
               device_map: Mapping[str, MapDevice] | None, offload_folder: str | os.PathLike | None,
               dtype: torch.dtype | None, offload_buffers: bool, keep_in_fp32: Sequence[str],
               index_needs_folder: bool, progress: ShardProgress) -> dict[str, IndexEntry]:
    tensors = model.state_dict(keep_vars=True)
    buffers = {n for n, _ in model.named_buffers(remove_duplicate=False)}
    homes = {n: _home(n, tensors[n], device_map, n in buffers, offload_buffers) for n in sources}
    copies = [n for n in sources if homes[n] == "disk" and ckpt.location(sources[n]) is None]
    if offload_folder is None and (copies or (index_needs_folder and "disk" in homes.values())):
        first = (copies or [n for n in homes if homes[n] == "disk"])[0]
        raise ConfigError(
            f"the device map puts {first!r} on 'disk', which needs an offload folder "
            + ("because the checkpoint stores it in a pickle file" if copies else
               "to hold the offload index") + " (got offload_folder=None). Pass "
            "offload_folder='offload' (any writable folder).",
            key="offload_folder", value=None, valid="a writable folder path")
    index: dict[str, IndexEntry] = {}
    loaded: dict[tuple[str, MapDevice], torch.Tensor] = {}
    targets = {n: _target_dtype(n, ckpt.dtype(k), tensors[n].dtype, dtype, keep_in_fp32)
               for n, k in sources.items()}
    maps, staged = FileMaps(), staged_to_gpus(ckpt, sources, homes, progress)
    copied = copied_to_cpu(ckpt, sources, homes, targets, maps, progress)
    resident_first = sorted(sources, key=lambda n: homes[n] == "disk")
    before = _Before(model)  # an interrupt or error here puts back every tensor changed
    try:
        for name in resident_first:
            before.keep(name)
            key, home, target = sources[name], homes[name], targets[name]
            shared = loaded.get((key, home))
            if home == "disk":  # tied to a resident tensor: share it rather than offload a copy
                shared = next((t for (k, _), t in loaded.items() if k == key), None)
            if shared is not None and shared.dtype == target:
                _share(model, name, shared)  # a tied alias: one tensor, never a second read
            elif home == "disk":
                location = ckpt.location(key)
                if location is None:
                    assert offload_folder is not None, "a disk weight stored in a pickle is in `copies`, checked above"
                    offload_weight(ckpt.read(key).to(target), name, offload_folder, index)
                else:
                    index[name] = {"safetensors_file": location.path, "weight_name": key,
                                   "dtype": str(target).removeprefix("torch.")}
                set_module_tensor_to_device(model, name, "meta", dtype=target)
            elif home == "meta":
                set_module_tensor_to_device(model, name, "meta", dtype=target)
            else:
                value = resident_value(ckpt, key, home, target, maps, staged, copied)
                set_module_tensor_to_device(model, name, home, value=value, dtype=target)
                loaded[(key, home)] = model.get_parameter(name) if name not in buffers \
                    else model.get_buffer(name)
            progress.done(key)
            progress.tick()
    except BaseException:
        before.restore()
        raise
    if offload_folder is not None and (copies or index_needs_folder):
        save_offload_index(index, offload_folder)
    return index


def _check_whole_tensor_loading(full_state_dict: bool, broadcast_from_rank0: bool,
                                offload_8bit_bnb: bool = False) -> None:
    """Reject Accelerate's FSDP/DTensor and bitsandbytes loading options: nbaccel loads whole
    tensors into plain modules, in every process that asks."""
    if full_state_dict is not True:
        raise ConfigError(
            f"full_state_dict={full_state_dict!r} is not supported: nbaccel loads whole tensors "
            "into plain (not DTensor-sharded) modules, so only full_state_dict=True is valid. "
            "Drop the argument, or load sharded state with torch.distributed.checkpoint.",
            key="full_state_dict", value=full_state_dict, valid=[True])
    if broadcast_from_rank0 is not False:
        raise ConfigError(
            f"broadcast_from_rank0={broadcast_from_rank0!r} is not supported: nbaccel does not "
            "broadcast weights between processes, so only broadcast_from_rank0=False is valid. "
            "Drop the argument and let each process load the checkpoint (safetensors files are "
            "memory-mapped, so processes on one machine share the pages).",
            key="broadcast_from_rank0", value=broadcast_from_rank0, valid=[False])
    if offload_8bit_bnb is not False:
        raise ConfigError(
            f"offload_8bit_bnb={offload_8bit_bnb!r} is not supported: nbaccel does not handle "
            "bitsandbytes 8-bit modules, so only offload_8bit_bnb=False is valid. Drop the "
            "argument, or load quantized models with transformers' from_pretrained.",
            key="offload_8bit_bnb", value=offload_8bit_bnb, valid=[False])


def load_checkpoint_in_model(model: nn.Module, checkpoint: str | os.PathLike,
                             device_map: Mapping[str, Device] | None = None,
                             offload_folder: str | os.PathLike | None = None,
                             dtype: torch.dtype | str | None = None,
                             offload_state_dict: bool | None = None,
                             offload_buffers: bool = False,
                             keep_in_fp32_modules: Sequence[str] | None = None,
                             offload_8bit_bnb: bool = False,
                             strict: bool = False, full_state_dict: bool = True,
                             broadcast_from_rank0: bool = False, show_progress: bool = True) -> None:
    """Load a checkpoint into a model (often built with ``init_empty_weights``), by device map.

    Args:
        model: the model; its tensors may be on the meta device.
        checkpoint: a ``.safetensors``/``.bin``/``.pt`` file, a ``*.index.json`` of shards, or a
            folder holding either.
        device_map: ``{module name: device}``; ``None`` loads every tensor where it is (meta
            tensors to CPU).
        offload_folder: where weights mapped to ``"disk"`` go; from safetensors checkpoints only
            a small ``index.json`` pointing into the checkpoint is written there.
        dtype: load floating-point weights in this dtype.
        offload_state_dict: accepted for Accelerate compatibility; unneeded, since checkpoint
            shards are memory-mapped or read per tensor, never held whole.
        offload_buffers: with ``"disk"`` modules, offload their buffers too.
        keep_in_fp32_modules: module names whose weights stay in float32 whatever ``dtype``.
        offload_8bit_bnb: accepted for Accelerate compatibility; only ``False`` is supported
            (bitsandbytes 8-bit modules are not handled).
        strict: make unexpected keys, and missing keys of tensors that already have values,
            errors instead of warnings (a missing tensor still on meta is always an error).
        full_state_dict: accepted for Accelerate compatibility; only ``True`` (whole tensors,
            no DTensor shards) is supported.
        broadcast_from_rank0: accepted for Accelerate compatibility; only ``False`` is
            supported: each process reads the checkpoint itself.
        show_progress: show a "Loading checkpoint shards" bar (``tqdm.auto``: a widget in a
            notebook, text on stderr elsewhere) when the checkpoint has more than one file.

    Raises:
        CheckpointMismatchError: missing or unexpected keys, or shape mismatches; the model is
            unchanged.
        CheckpointError: a file is missing, truncated or corrupt.
        UnsafeCheckpointError: a pickle would run code.
        DeviceMapError: the device map does not fit the model.
        ConfigError: a ``"disk"`` entry without ``offload_folder``; ``full_state_dict=False``,
            ``broadcast_from_rank0=True`` or ``offload_8bit_bnb=True``, which are not supported.

    Example:
        >>> import tempfile, safetensors.torch
        >>> path = tempfile.mktemp(suffix=".safetensors")
        >>> safetensors.torch.save_file(torch.nn.Linear(2, 2).state_dict(), path)
        >>> from nbaccel.big_modeling.init import init_empty_weights
        >>> with init_empty_weights():
        ...     model = torch.nn.Linear(2, 2)
        >>> load_checkpoint_in_model(model, path)
        >>> model.weight.device.type
        'cpu'
    """
    _check_whole_tensor_loading(full_state_dict, broadcast_from_rank0, offload_8bit_bnb)
    as_dtype = as_torch_dtype(dtype)
    checked = None if device_map is None else check_device_map(model, device_map, on_this_machine=True)
    _load(model, checkpoint, checked, offload_folder, as_dtype, offload_buffers,
          list(keep_in_fp32_modules or ()), strict, index_needs_folder=True,
          show_progress=show_progress)


def load_checkpoint_and_dispatch(model: nn.Module, checkpoint: str | os.PathLike,
                                 device_map: DeviceMapStrategy | Mapping[str, Device] | None = None,
                                 max_memory: MaxMemory | None = None,
                                 no_split_module_classes: Sequence[str] | None = None,
                                 offload_folder: str | os.PathLike | None = None,
                                 offload_buffers: bool = False,
                                 dtype: torch.dtype | str | None = None,
                                 offload_state_dict: bool | None = None,
                                 skip_keys: str | Sequence[str] | None = None,
                                 preload_module_classes: Sequence[str] | None = None,
                                 force_hooks: bool = False, strict: bool = False,
                                 full_state_dict: bool = True, broadcast_from_rank0: bool = False,
                                 keep_in_fp32_modules: Sequence[str] | None = None,
                                 show_progress: bool = True) -> nn.Module:
    """Load a checkpoint and dispatch the model over devices, offloading what does not fit.

    Disk-offloaded weights of a safetensors checkpoint are read from the checkpoint's own files
    when their module runs, so ``offload_folder`` is only needed (and written to) for pickle
    checkpoints.

    Args:
        model: the model, usually built with ``init_empty_weights``.
        checkpoint: a file, a ``*.index.json`` of shards, or a folder holding either.
        device_map: a map, or ``"auto"``, ``"balanced"``, ``"balanced_low_0"``,
            ``"sequential"``; ``None`` only loads.
        max_memory: ``{device: size}`` budget for the strategies (default: what is free).
        no_split_module_classes: class names kept whole on one device (transformer blocks).
        offload_folder: where pickle weights mapped to ``"disk"`` are copied.
        offload_buffers: offload buffers of offloaded modules too.
        dtype: load floating-point weights in this dtype.
        offload_state_dict: accepted for Accelerate compatibility; unneeded here.
        skip_keys: keyword arguments of ``forward`` the hooks leave where they are.
        preload_module_classes: as in :func:`~nbaccel.big_modeling.dispatch.dispatch_model`.
        force_hooks: attach hooks even when everything is on one device.
        strict: as in :func:`load_checkpoint_in_model`.
        full_state_dict: as in :func:`load_checkpoint_in_model`.
        broadcast_from_rank0: as in :func:`load_checkpoint_in_model`.
        keep_in_fp32_modules: as in :func:`load_checkpoint_in_model`.
        show_progress: as in :func:`load_checkpoint_in_model`.

    Returns:
        The dispatched model, with ``model.hf_device_map`` set.

    Raises:
        CheckpointMismatchError, CheckpointError, UnsafeCheckpointError, DeviceMapError,
        ConfigError: as in :func:`load_checkpoint_in_model` and :func:`resolve_device_map`.

    Example:
        >>> import tempfile, safetensors.torch
        >>> path = tempfile.mktemp(suffix=".safetensors")
        >>> full = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
        >>> safetensors.torch.save_file(full.state_dict(), path)
        >>> from nbaccel.big_modeling.init import init_empty_weights
        >>> with init_empty_weights():
        ...     model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
        >>> model = load_checkpoint_and_dispatch(model, path, "auto", max_memory={"cpu": 700})
        >>> model.hf_device_map
        {'0': 'cpu', '1': 'disk', '2': 'disk', '3': 'disk'}
        >>> x = torch.ones(1, 8); torch.allclose(model(x), full(x))
        True
    """
    _check_whole_tensor_loading(full_state_dict, broadcast_from_rank0)
    as_dtype = as_torch_dtype(dtype)
    # On GPUs, offloaded layers stream through OFFLOAD_SLOTS device buffers: keep room for them
    # (fewer when the budget cannot hold them), and run them on the budget's first GPU.
    plan = None if device_map is None else plan_device_map(
        model, device_map, max_memory, no_split_module_classes, as_dtype, offload_buffers,
        reserved_slots=OFFLOAD_SLOTS)
    checked = None if plan is None else plan.device_map
    if checked is not None:
        dispatch_entries(model, checked)  # a map dispatch would reject fails before any read
    index = _load(model, checkpoint, checked, offload_folder, as_dtype, offload_buffers,
                  list(keep_in_fp32_modules or ()), strict, index_needs_folder=False,
                  show_progress=show_progress)
    if plan is None:  # no device map: loaded only
        return model
    return dispatch_model(model, plan.device_map, offload_dir=offload_folder, offload_index=index,
                          offload_buffers=offload_buffers, skip_keys=skip_keys,
                          preload_module_classes=preload_module_classes, force_hooks=force_hooks,
                          main_device=plan.main_device, no_split_module_classes=no_split_module_classes,
                          offload_slots=plan.slots if isinstance(device_map, str) else OFFLOAD_SLOTS)

