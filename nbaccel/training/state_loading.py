"""`load_state`: read and check every file of a training-state folder, then change the prepared objects.

What always holds: a refused load changes nothing. Every file a plain (non-sharded) checkpoint
holds is read and checked first (unsafe pickles, truncated or corrupt files, missing files,
model keys and shapes, optimizer parameter groups); only when all of them pass are the models,
optimizers, schedulers, dataloaders, scaler, registered objects and RNG states changed. No file
runs code while loaded unless ``load_kwargs={"weights_only": False}`` opts in (see
:mod:`nbaccel.safe_load`). Every file comes from one save, even while another process saves
into the same folder (:mod:`nbaccel.training.checkpoint_generations` holds that save open).
DeepSpeed engines and sharded FSDP models read their own files,
after the checks of everything else. A full FSDP model's weights and optimizer state are read
by rank 0 alone and broadcast into the shards, so an N-rank machine holds one copy in host
memory, not N; every rank then learns whether any rank refused the checkpoint, and all raise.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch

from nbaccel.errors import CheckpointError, CheckpointMismatchError
from nbaccel.file_kinds import regular_file
from nbaccel.process_state import ProcessState
from nbaccel.safe_load import load_state_file
from nbaccel.training.checkpoint_generations import MARKER, PinnedCheckpoint, pinned_checkpoint
from nbaccel.training.checkpointing import (
    check_fits,
    load_into,
    numbered_name,
)
from nbaccel.training.deepspeed_engine import CHECKPOINT_TAG, is_deepspeed_engine
from nbaccel.training.prepared import PreparedObjects
from nbaccel.training.random import restore_rng_state
from nbaccel.training.training_state import (
    CheckpointContext,
    LoadedState,
    checkpoint_folder,
    engine_owned,
)
from nbaccel.training.unwrap import unwrap_model

__all__ = ["load_accelerator_state"]

Step = Callable[[], None]


def _need(path: Path) -> Path:
    if not path.exists():
        raise CheckpointError(f"the checkpoint has no {path.name} (it was saved with fewer prepared objects than "
                              f"are prepared now); prepare the same objects as when it was saved", path=str(path))
    return path


def _read_weights(path: Path, load_kwargs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """A model's weights file, as a flat ``{name: tensor}`` dict; a damaged file is a CheckpointError naming it."""
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            with regular_file(path) as name:  # a FIFO named model.safetensors would block the load for good
                weights = load_file(name)
        except CheckpointError:
            raise
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read {str(path)!r} (truncated or corrupt?): {exc}. Fix: save the "
                                  "checkpoint again, or load an earlier one", path=str(path)) from None
    else:
        weights = load_state_file(path, load_kwargs)
    if not isinstance(weights, Mapping):
        raise CheckpointError(f"{str(path)!r} holds a {type(weights).__name__}, not a state dict; "
                              "pass the folder a finished save_state wrote", path=str(path))
    return dict(weights)


def _plan_models(prepared: PreparedObjects, pinned: PinnedCheckpoint, strict: bool, load_kwargs: Mapping[str, Any],
                 reader: bool) -> list[Step]:
    from nbaccel.training.fsdp import (
        is_fsdp_model,
        load_full_model_state_dict,
        sharded_load,
    )

    source = pinned.root
    engines: list[Step] = []
    plain = []
    for i, model in enumerate(prepared.models):
        shards = source / f"pytorch_model_fsdp_{i}"
        if is_deepspeed_engine(model):
            _need(source / CHECKPOINT_TAG)
            engine = cast(Any, model)  # a deepspeed.DeepSpeedEngine (deepspeed has no type information)
            engines.append(partial(engine.load_checkpoint, str(source), tag=CHECKPOINT_TAG,
                                   load_optimizer_states=True, load_lr_scheduler_states=True))
        elif shards.is_dir():
            optimizer = prepared.optimizer_for(i)
            inner = optimizer.optimizer if optimizer is not None else None
            engines.append(partial(sharded_load, model, inner, shards))
        else:
            plain.append(model)
    for hook in list(prepared.load_state_pre_hooks.values()):  # may take models out of `plain` to load them itself
        hook(plain, str(pinned.path))
    steps: list[Step] = []
    for i, model in enumerate(plain):
        safe = source / numbered_name("model", i, "safetensors")
        path = safe if safe.exists() else _need(source / numbered_name("pytorch_model", i, "bin"))
        if is_fsdp_model(model) and not reader:
            steps.append(partial(load_full_model_state_dict, model, {}))  # rank 0 reads and broadcasts
            continue
        weights = _read_weights(path, load_kwargs)
        target = model if is_fsdp_model(model) else unwrap_model(model, keep_torch_compile=False)
        check_fits(target, weights, strict=strict, path=path)  # an FSDP model's DTensors have the full shapes
        if is_fsdp_model(model):
            steps.append(partial(load_full_model_state_dict, model, weights))
        else:
            steps.append(partial(load_into, target, weights, strict=strict))
    return engines + steps


def _check_optimizer(optimizer: Any, state: Any, path: Path) -> None:
    """What ``Optimizer.load_state_dict`` would refuse, refused before anything changes."""
    if not isinstance(state, Mapping) or "param_groups" not in state or "state" not in state:
        raise CheckpointError(f"{str(path)!r} holds no optimizer state (no 'state' and 'param_groups'); pass the "
                              "folder a finished save_state wrote", path=str(path))
    saved = [len(g["params"]) for g in state["param_groups"]]
    own = [len(g["params"]) for g in optimizer.param_groups]
    if saved != own:
        raise CheckpointMismatchError(
            f"{str(path)!r} holds an optimizer with parameter groups of sizes {saved}, but the prepared optimizer's "
            f"are {own}: nothing was loaded. Fix: build the optimizer over the same parameters as when the "
            "checkpoint was saved", path=str(path))


def _plan_rest(prepared: PreparedObjects, context: CheckpointContext, source: Path, load_kwargs: Mapping[str, Any],
               reader: bool) -> list[Step]:
    from nbaccel.training.fsdp import is_fsdp_model, load_full_optimizer_state_dict

    def load(path: Path) -> Any:
        return load_state_file(_need(path), load_kwargs)

    steps: list[Step] = []
    for i, optimizer in enumerate(prepared.optimizers):
        if (source / f"pytorch_model_fsdp_{i}").is_dir() or engine_owned(optimizer):
            continue
        path = source / numbered_name("optimizer", i, "bin")
        fsdp = i < len(prepared.models) and is_fsdp_model(prepared.models[i])
        state = load(path) if reader or not fsdp else {}  # FSDP: rank 0 reads and broadcasts
        if fsdp:
            steps.append(partial(load_full_optimizer_state_dict, prepared.models[i], optimizer.optimizer, state))
        else:
            _check_optimizer(optimizer, state, path)
            steps.append(partial(optimizer.load_state_dict, state))
    for i, scheduler in enumerate(prepared.schedulers):
        if not engine_owned(scheduler):
            steps.append(partial(scheduler.load_state_dict, load(source / numbered_name("scheduler", i, "bin"))))
    for i, loader in enumerate(prepared.dataloaders):
        sampler = source / numbered_name("sampler", i, "bin")
        if callable(getattr(loader, "load_state_dict", None)) and sampler.exists():
            steps.append(partial(loader.load_state_dict, load(sampler)))
    if context.scaler is not None and (source / "scaler.pt").exists():
        steps.append(partial(context.scaler.load_state_dict, load(source / "scaler.pt")))
    for i, obj in enumerate(prepared.custom_objects):
        steps.append(partial(obj.load_state_dict, load(source / f"custom_checkpoint_{i}.pkl")))
    rng = source / f"random_states_{context.process.process_index}.pkl"
    if rng.exists():
        steps.append(partial(restore_rng_state, load(rng)))
    return steps


def _read_marker(pinned: PinnedCheckpoint) -> dict[str, Any]:
    """What the marker of a finished save holds (``{}`` in Accelerate's folders), read once like every file.

    Raises:
        CheckpointError: the marker is not a regular file, or not a JSON object.
    """
    if not pinned.complete:
        return {}
    path = pinned.root / MARKER
    with regular_file(path) as name:  # a FIFO named like the marker would block the load
        raw = Path(name).read_bytes()
    try:
        marker = json.loads(raw)
    except ValueError:
        marker = None
    if not isinstance(marker, dict):
        raise CheckpointError(f"{str(path)!r} is not the JSON object a finished save_state writes. Fix: save the "
                              "checkpoint again, or load an earlier one", path=str(path))
    return marker


def _warn_on_other_process_count(process: ProcessState, pinned: PinnedCheckpoint, marker: Mapping[str, Any]) -> None:
    """Accelerate loads a checkpoint into any number of processes; say what that loses (RNG states)."""
    source = pinned.path
    saved = marker.get("num_processes")  # Accelerate's folders: one RNG file per rank
    if not isinstance(saved, int):
        saved = len(list(pinned.root.glob("random_states_*.pkl")))
    if saved and saved != process.num_processes and process.is_main_process:
        warnings.warn(f"the checkpoint {str(source)!r} was saved by {saved} processes and is loaded by "
                      f"{process.num_processes}: models, optimizers and schedulers load as usual, but random states "
                      f"are restored only for ranks below {min(saved, process.num_processes)}, so the resumed run "
                      f"does not repeat the original's random draws. To resume exactly, load it with {saved} "
                      "processes", stacklevel=4)


def _agree(failure: Exception | None, input_dir: str | Path | None = None) -> None:
    """Every rank learns whether any rank refused the checkpoint, so none is left waiting in a broadcast.

    A rank that read nothing itself raises the refusing rank's own error (same type and fields:
    a shape mismatch seen by rank 0 is a ``CheckpointMismatchError`` on every rank).

    Raises:
        CheckpointError: another rank refused it (its error, or, where that cannot be pickled, a
            ``CheckpointError`` carrying its message); this rank's own refusal is re-raised by the caller.
    """
    import pickle

    import torch.distributed as dist

    sent: Exception | str | None = failure
    if failure is not None:
        try:
            pickle.dumps(failure)
        except Exception:  # noqa: BLE001 - send its text instead
            sent = f"{type(failure).__name__}: {failure}"
    said: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(said, sent)
    refused = [(rank, told) for rank, told in enumerate(said) if told is not None]
    if failure is None and refused:
        rank, told = refused[0]
        if isinstance(told, Exception):
            raise told
        raise CheckpointError(f"rank {rank} refused the checkpoint, so nothing was loaded on any rank: {told}",
                              path=str(input_dir))


def load_accelerator_state(prepared: PreparedObjects, context: CheckpointContext, input_dir: str | Path | None,
                           strict: bool = True, load_kwargs: dict[str, Any] | None = None) -> LoadedState:
    """Restore what :func:`~nbaccel.training.training_state.save_accelerator_state` wrote into the prepared objects.

    Everything is read and checked before anything changes (see the module docstring).

    Raises:
        CheckpointError: the folder holds no complete checkpoint, lacks a file for a prepared
            object, or a file is truncated or corrupt (the error names the file).
        UnsafeCheckpointError: a file would run code when loaded (``load_kwargs`` did not opt in).
        CheckpointMismatchError: a model's keys or shapes, or an optimizer's parameter groups, do not match.
        CheckpointError: (FSDP) another rank refused the checkpoint; its message is included.
    """
    from nbaccel.training.fsdp import is_fsdp_model

    project = context.project
    process = context.process
    # Full FSDP states are read by rank 0 alone and broadcast (one copy in host memory, not one per rank).
    shared = process.num_processes > 1 and any(is_fsdp_model(m) for m in prepared.models)
    pinned: PinnedCheckpoint | None = None
    with contextlib.ExitStack() as hold:
        try:
            folder = checkpoint_folder(project, input_dir, for_load=True)
            pinned = hold.enter_context(pinned_checkpoint(folder))  # one save, held until every step ran
            marker = _read_marker(pinned)
            _warn_on_other_process_count(process, pinned, marker)
            kwargs = dict(load_kwargs or {})
            reader = not shared or process.is_main_process
            steps = (_plan_models(prepared, pinned, strict, kwargs, reader)
                     + _plan_rest(prepared, context, pinned.root, kwargs, reader))
        except Exception as exc:
            if isinstance(exc, CheckpointError):
                _name_the_folder(exc, pinned)
            if shared:
                _agree(exc)
            raise
        if shared:
            _agree(None, input_dir)
        for step in steps:  # every file is read and checked: now change the objects
            step()
        # the accumulation counter, so a resumed run syncs on the same micro-batches
        step_count = int(marker.get("step", 0)) if pinned.complete else None
    if project.automatic_checkpoint_naming and input_dir is None:
        project.iteration = int(folder.name.split("_")[-1]) + 1
    context.process.wait_for_everyone()
    return LoadedState(pinned.path, step_count)


def _name_the_folder(exc: CheckpointError, pinned: PinnedCheckpoint | None) -> None:
    """Say the checkpoint folder's own name where ``exc`` names the ``/proc/self/fd`` path it was read through."""
    if pinned is None or pinned.root == pinned.path:
        return
    inner, outer = str(pinned.root), str(pinned.path)
    exc.args = tuple(a.replace(inner, outer) if isinstance(a, str) else a for a in exc.args)
    if exc.path is not None:
        exc.path = exc.path.replace(inner, outer)
