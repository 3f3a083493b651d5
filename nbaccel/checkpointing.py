"""Checkpoints: `save_state` / `load_state` written atomically, and `save_model`'s sharded safetensors.

A training state is a folder with Accelerate's file names: ``model.safetensors`` (then
``model_1.safetensors``, ...), ``optimizer.bin``, ``scheduler.bin``, ``sampler.bin``,
``scaler.pt``, ``random_states_<rank>.pkl`` and ``custom_checkpoint_<i>.pkl``. Every process
writes into a temporary sibling folder; only when all have finished does the main process swap
it into place, so a crash during a save leaves the previous checkpoint whole. The folder holds
``nbaccel_checkpoint.json`` once complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from nbaccel.errors import CheckpointError, CheckpointMismatchError, ConfigError

__all__ = ["load_accelerator_state", "parse_size", "save_accelerator_state", "save_model_shards"]

MARKER = "nbaccel_checkpoint.json"
SAFE_WEIGHTS = "model.safetensors"
TORCH_WEIGHTS = "pytorch_model.bin"
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def _name(stem: str, index: int, ext: str) -> str:
    return f"{stem}.{ext}" if index == 0 else f"{stem}_{index}.{ext}"


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a string such as ``"10GB"``, ``"500MB"`` or ``"2GiB"``.

    Raises:
        ConfigError: the string is not a number followed by a unit.

    Example:
        >>> parse_size("5MB"), parse_size("1KiB")
        (5000000, 1024)
    """
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]+)\s*", str(size)) if isinstance(size, str) else None
    if match is None or match.group(2).upper() not in _UNITS:
        raise ConfigError(f"`max_shard_size` must be a positive int of bytes or a size like '10GB' (got {size!r} of "
                          f"type {type(size).__name__}); units: {sorted(_UNITS, key=_UNITS.get)}",
                          key="max_shard_size", value=size, valid="an int > 0 or '<number><unit>'")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


# --------------------------------------------------------------------------- tensors on disk


def _dedupe(state_dict: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Drop later names of tensors that share storage (tied weights); safetensors refuses them."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if not torch.is_tensor(tensor):
            continue
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
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
    """What tied names share: the storage on CPU/CUDA; on XLA (no storage pointers) the tensor object."""
    if tensor.device.type == "xla":
        return ("xla", id(tensor))
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset())


def load_into(model: torch.nn.Module, weights: Mapping[str, torch.Tensor], strict: bool = True) -> None:
    """Load ``weights`` into ``model``; names missing only because they were tied aliases are fine.

    Raises:
        CheckpointMismatchError: keys are missing or unexpected (with ``strict``).
    """
    result = model.load_state_dict(weights, strict=False)
    if not strict:
        return
    own = model.state_dict(keep_vars=True)
    present = {_alias_key(t) for n, t in own.items() if n in weights}
    missing = [n for n in result.missing_keys if _alias_key(own[n]) not in present]
    if missing or result.unexpected_keys:
        raise CheckpointMismatchError(
            f"the checkpoint does not fit {type(model).__name__}: missing keys {missing}, unexpected keys "
            f"{list(result.unexpected_keys)}; load it into the model it was saved from, or pass strict=False",
            missing_keys=tuple(missing), unexpected_keys=tuple(result.unexpected_keys))


def save_model_shards(state_dict: Mapping[str, Any], save_directory: Path, max_shard_size: int | str = "10GB",
                      safe_serialization: bool = True) -> list[Path]:
    """Write ``state_dict`` as weight files of at most ``max_shard_size``, with an index when sharded.

    One shard is ``model.safetensors``; more are ``model-00001-of-0000N.safetensors`` plus
    ``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map": ...}``),
    as Accelerate and Transformers write them. Stale shards of an earlier save are removed.

    Returns:
        The files written.
    """
    limit = parse_size(max_shard_size)
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
    names = [base] if len(shards) == 1 else [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.{ext}" for i in range(len(shards))]
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


def _siblings(folder: Path) -> tuple[Path, Path]:
    return folder.with_name(f".{folder.name}.nbaccel-tmp"), folder.with_name(f".{folder.name}.nbaccel-old")


def resolve_checkpoint(folder: Path) -> Path:
    """The complete checkpoint at ``folder`` (or the one a crash mid-swap left beside it).

    Raises:
        CheckpointError: no complete checkpoint is there.
    """
    _, old = _siblings(folder)
    if (folder / MARKER).is_file():
        return folder
    if not folder.exists() and (old / MARKER).is_file():
        return old  # crashed between the two renames: the previous checkpoint is whole
    if folder.is_dir() and any(folder.glob("model*")) and (folder / "optimizer.bin").exists() or \
            folder.is_dir() and any(folder.glob("random_states_*.pkl")):
        return folder  # written by Accelerate: no marker, but the same layout
    raise CheckpointError(f"no complete checkpoint at {str(folder)!r}: it has no {MARKER} (an interrupted "
                          "save leaves the previous checkpoint in place, or none if there was none); pass the "
                          "folder a finished save_state wrote", path=str(folder))


def save_state_folder(folder: Path, write: Callable[[Path], None], *, barrier: Callable[[], None],
                      is_writer: bool, summary: Mapping[str, Any]) -> Path:
    """Run ``write(tmp)`` on every process, then swap ``tmp`` into ``folder`` atomically.

    Args:
        folder: the checkpoint folder.
        write: writes this process's files into the folder it is given.
        barrier: waits for every process.
        is_writer: this process prepares and swaps the folder (main process, or local main per node).
        summary: what the checkpoint holds, stored in its marker file.
    """
    tmp, old = _siblings(folder)
    if is_writer:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    write(tmp)
    barrier()
    if is_writer:
        (tmp / MARKER).write_text(json.dumps(dict(summary), indent=2, sort_keys=True) + "\n")
        _fsync_dir(tmp)
        shutil.rmtree(old, ignore_errors=True)
        if folder.exists():
            os.rename(folder, old)
        os.rename(tmp, folder)
        _fsync_dir(folder.parent)
        shutil.rmtree(old, ignore_errors=True)
    barrier()
    return folder


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- the Accelerator's state


def _checkpoint_folder(acc: Any, output_dir: str | Path | None, *, for_load: bool) -> Path:
    """The folder to save into / load from, following ``ProjectConfiguration``'s automatic naming."""
    project = acc.project_configuration
    if output_dir is not None:
        return Path(output_dir)
    if not project.automatic_checkpoint_naming or project.project_dir is None:
        raise ConfigError("save_state/load_state need a folder: pass one, or use ProjectConfiguration(project_dir=..., "
                          "automatic_checkpoint_naming=True)", key="output_dir", value=None, valid="a folder path")
    root = Path(project.project_dir) / "checkpoints"
    if not for_load:
        folder = root / f"checkpoint_{project.iteration}"
        if folder.exists():
            raise CheckpointError(
                f"automatic checkpoint naming would write {str(folder)!r}, which exists already (save_iteration="
                f"{project.iteration}); it is not overwritten. Fix: continue the numbering from the latest checkpoint "
                "with accelerator.load_state() first, or set accelerator.project_configuration.iteration to an "
                "unused number", path=str(folder))
        return folder
    found = sorted((int(p.name.split("_")[-1]), p) for p in root.glob("checkpoint_*") if p.name.split("_")[-1].isdigit())
    if not found:
        raise CheckpointError(f"no automatic checkpoint under {str(root)!r}; save one with save_state() first",
                              path=str(root))
    return found[-1][1]


def _prune(acc: Any) -> None:
    """Keep only ``total_limit`` automatic checkpoints (oldest removed first), before a new one is written."""
    project = acc.project_configuration
    if not project.automatic_checkpoint_naming or project.total_limit is None or not acc._is_writer():
        return
    root = Path(project.project_dir) / "checkpoints"
    found = sorted((int(p.name.split("_")[-1]), p) for p in root.glob("checkpoint_*") if p.name.split("_")[-1].isdigit())
    for _, old in found[: max(len(found) + 1 - project.total_limit, 0)]:
        shutil.rmtree(old, ignore_errors=True)


def _optimizer_state(acc: Any, index: int, optimizer: Any) -> Any:
    from nbaccel.fsdp import full_optimizer_state_dict, is_fsdp_model

    if index < len(acc._models) and is_fsdp_model(acc._models[index]):
        return full_optimizer_state_dict(acc._models[index], optimizer.optimizer)
    state = optimizer.state_dict()
    if acc.device.type == "xla":
        from nbaccel.ops import send_to_device

        state = send_to_device(state, torch.device("cpu"))
    return state


def _engine_owned(obj: Any) -> bool:
    """Whether a DeepSpeed engine saves and loads ``obj`` with the model."""
    from nbaccel.deepspeed_engine import DeepSpeedOptimizerWrapper, DeepSpeedSchedulerWrapper

    return isinstance(obj, (DeepSpeedOptimizerWrapper, DeepSpeedSchedulerWrapper))


def _write_state(acc: Any, tmp: Path, safe_serialization: bool) -> None:
    from nbaccel.deepspeed_engine import CHECKPOINT_TAG, is_deepspeed_engine
    from nbaccel.fsdp import is_fsdp_model, sharded_save
    from nbaccel.random import capture_rng_state

    writer = acc._is_writer()
    sharded = acc.fsdp_plugin is not None and acc.fsdp_plugin.state_dict_type == "SHARDED_STATE_DICT"
    weights = []
    for i, model in enumerate(acc._models):
        if is_deepspeed_engine(model):  # model, optimizer and scheduler, every rank its own shards
            model.save_checkpoint(str(tmp), tag=CHECKPOINT_TAG)
        elif sharded and is_fsdp_model(model):
            optimizer = acc._optimizers[i].optimizer if i < len(acc._optimizers) else None
            sharded_save(model, optimizer, tmp / f"pytorch_model_fsdp_{i}")
        else:
            weights.append(acc.get_state_dict(model))
    for hook in list(acc._save_state_pre_hooks.values()):  # may drop entries of `weights` to save them itself
        hook(list(acc._models), weights, str(tmp))
    if writer:
        for i, state in enumerate(weights):  # numbered in order, as Accelerate does after its hooks
            write_weights(state, tmp / _name("model" if safe_serialization else "pytorch_model", i,
                                             "safetensors" if safe_serialization else "bin"), safe_serialization)
    for i, optimizer in enumerate(acc._optimizers):
        if sharded and i < len(acc._models) and is_fsdp_model(acc._models[i]) or _engine_owned(optimizer):
            continue
        state = _optimizer_state(acc, i, optimizer)
        if writer:
            torch.save(state, tmp / _name("optimizer", i, "bin"))
    if writer:
        for i, scheduler in enumerate(acc._schedulers):
            if not _engine_owned(scheduler):
                torch.save(scheduler.state_dict(), tmp / _name("scheduler", i, "bin"))
        for i, loader in enumerate(acc._dataloaders):
            if callable(getattr(loader, "state_dict", None)):
                torch.save(loader.state_dict(), tmp / _name("sampler", i, "bin"))
        if acc.scaler is not None:
            torch.save(acc.scaler.state_dict(), tmp / "scaler.pt")
        for i, obj in enumerate(acc._custom_objects):
            torch.save(obj.state_dict(), tmp / f"custom_checkpoint_{i}.pkl")
    torch.save(capture_rng_state(), tmp / f"random_states_{acc.process_index}.pkl")


def save_accelerator_state(acc: Any, output_dir: str | Path | None, safe_serialization: bool = True) -> Path:
    """Write ``acc``'s whole training state into ``output_dir`` atomically (see the module docstring).

    Raises:
        ConfigError: no folder was given and automatic naming is off.
        CheckpointError: the automatically named folder exists already.
    """
    folder = _checkpoint_folder(acc, output_dir, for_load=False)
    _prune(acc)
    summary = {"format": "nbaccel-training-state", "version": 1, "num_processes": acc.num_processes,
               "models": len(acc._models), "optimizers": len(acc._optimizers), "schedulers": len(acc._schedulers),
               "dataloaders": len(acc._dataloaders), "custom_objects": len(acc._custom_objects), "step": acc.step}
    save_state_folder(folder, lambda tmp: _write_state(acc, tmp, safe_serialization), barrier=acc.wait_for_everyone,
                      is_writer=acc._is_writer(), summary=summary)
    if acc.project_configuration.automatic_checkpoint_naming and output_dir is None:
        acc.project_configuration.iteration += 1
    return folder


def _need(path: Path) -> Path:
    if not path.exists():
        raise CheckpointError(f"the checkpoint has no {path.name} (it was saved with fewer prepared objects than "
                              f"are prepared now); prepare the same objects as when it was saved", path=str(path))
    return path


def _read_models(acc: Any, source: Path, strict: bool) -> None:
    from nbaccel.deepspeed_engine import CHECKPOINT_TAG, is_deepspeed_engine
    from nbaccel.fsdp import is_fsdp_model, load_full_model_state_dict, sharded_load

    plain = []
    for i, model in enumerate(acc._models):
        shards = source / f"pytorch_model_fsdp_{i}"
        if is_deepspeed_engine(model):
            _need(source / CHECKPOINT_TAG)
            model.load_checkpoint(str(source), tag=CHECKPOINT_TAG, load_optimizer_states=True,
                                  load_lr_scheduler_states=True)
        elif shards.is_dir():
            optimizer = acc._optimizers[i].optimizer if i < len(acc._optimizers) else None
            sharded_load(model, optimizer, shards)
        else:
            plain.append(model)
    for hook in list(acc._load_state_pre_hooks.values()):  # may take models out of `plain` to load them itself
        hook(plain, str(source))
    for i, model in enumerate(plain):
        safe = source / _name("model", i, "safetensors")
        weights = read_weights(safe if safe.exists() else _need(source / _name("pytorch_model", i, "bin")))
        if is_fsdp_model(model):
            load_full_model_state_dict(model, weights)
        else:
            load_into(acc.unwrap_model(model, keep_torch_compile=False), weights, strict=strict)


def _read_rest(acc: Any, source: Path, load_kwargs: dict[str, Any]) -> None:
    from nbaccel.fsdp import is_fsdp_model, load_full_optimizer_state_dict
    from nbaccel.random import restore_rng_state

    def load(path: Path, **kwargs: Any) -> Any:
        return torch.load(_need(path), **({"map_location": "cpu", "weights_only": False} | kwargs))

    for i, optimizer in enumerate(acc._optimizers):
        if (source / f"pytorch_model_fsdp_{i}").is_dir() or _engine_owned(optimizer):
            continue
        state = load(source / _name("optimizer", i, "bin"), **load_kwargs)
        if i < len(acc._models) and is_fsdp_model(acc._models[i]):
            load_full_optimizer_state_dict(acc._models[i], optimizer.optimizer, state)
        else:
            optimizer.load_state_dict(state)
    for i, scheduler in enumerate(acc._schedulers):
        if not _engine_owned(scheduler):
            scheduler.load_state_dict(load(source / _name("scheduler", i, "bin"), **load_kwargs))
    for i, loader in enumerate(acc._dataloaders):
        if callable(getattr(loader, "load_state_dict", None)) and (source / _name("sampler", i, "bin")).exists():
            loader.load_state_dict(load(source / _name("sampler", i, "bin"), **load_kwargs))
    if acc.scaler is not None and (source / "scaler.pt").exists():
        acc.scaler.load_state_dict(load(source / "scaler.pt"))
    for i, obj in enumerate(acc._custom_objects):
        obj.load_state_dict(load(source / f"custom_checkpoint_{i}.pkl"))
    rng = source / f"random_states_{acc.process_index}.pkl"
    if rng.exists():
        restore_rng_state(load(rng))


def _saved_process_count(source: Path) -> int:
    """How many processes wrote the checkpoint (from its marker, or Accelerate's per-rank RNG files)."""
    marker = source / MARKER
    if marker.is_file():
        count = json.loads(marker.read_text()).get("num_processes")
        if isinstance(count, int):
            return count
    return len(list(source.glob("random_states_*.pkl")))


def _warn_on_other_process_count(acc: Any, source: Path) -> None:
    """Accelerate loads a checkpoint into any number of processes; say what that loses (RNG states)."""
    saved = _saved_process_count(source)
    if saved and saved != acc.num_processes and acc.is_main_process:
        warnings.warn(f"the checkpoint {str(source)!r} was saved by {saved} processes and is loaded by "
                      f"{acc.num_processes}: models, optimizers and schedulers load as usual, but random states "
                      f"are restored only for ranks below {min(saved, acc.num_processes)}, so the resumed run does "
                      f"not repeat the original's random draws. To resume exactly, load it with {saved} processes",
                      stacklevel=4)


def load_accelerator_state(acc: Any, input_dir: str | Path | None, strict: bool = True,
                           load_kwargs: dict[str, Any] | None = None) -> Path:
    """Restore what :func:`save_accelerator_state` wrote into ``acc``'s prepared objects.

    Raises:
        CheckpointError: the folder holds no complete checkpoint, or lacks a file for a prepared object.
        CheckpointMismatchError: a model's keys do not match (with ``strict``).
    """
    folder = _checkpoint_folder(acc, input_dir, for_load=True)
    source = resolve_checkpoint(folder)
    _warn_on_other_process_count(acc, source)
    _read_models(acc, source, strict)
    _read_rest(acc, source, dict(load_kwargs or {}))
    marker = source / MARKER
    if marker.is_file():  # the accumulation counter, so a resumed run syncs on the same micro-batches
        acc.step = int(json.loads(marker.read_text()).get("step", 0))
    if acc.project_configuration.automatic_checkpoint_naming and input_dir is None:
        acc.project_configuration.iteration = int(folder.name.split("_")[-1]) + 1
    acc.wait_for_everyone()
    return source
