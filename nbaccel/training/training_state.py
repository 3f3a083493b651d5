"""`save_state`: what an Accelerator prepared, written to a checkpoint folder (and where that folder is).

The functions here are given everything they use: the :class:`~nbaccel.training.prepared.PreparedObjects`
registry and a :class:`CheckpointContext` (the process, the project configuration, the fp16
scaler, the accumulation counter). They never reach into an Accelerator. The file layout
(Accelerate's names) and the atomic folder swap are :mod:`nbaccel.training.checkpointing`'s; reading a
folder back is :mod:`nbaccel.training.state_loading`'s.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from nbaccel.errors import CheckpointError, ConfigError, UnsafeCheckpointError
from nbaccel.process_state import ProcessState
from nbaccel.training.checkpointing import (
    numbered_name,
    remove_checkpoint,
    resolve_checkpoint,
    save_state_folder,
    write_weights,
)
from nbaccel.training.deepspeed_engine import (
    CHECKPOINT_TAG,
    DeepSpeedOptimizerWrapper,
    DeepSpeedSchedulerWrapper,
    is_deepspeed_engine,
)
from nbaccel.training.deepspeed_engine import state_dict as deepspeed_state_dict
from nbaccel.training.plugins import ProjectConfiguration
from nbaccel.training.prepared import PreparedObjects
from nbaccel.training.random import capture_rng_state
from nbaccel.training.unwrap import unwrap_model

__all__ = ["CheckpointContext", "LoadedState", "checkpoint_folder", "engine_owned", "model_state_dict",
           "save_accelerator_state"]


@dataclass(frozen=True)
class CheckpointContext:
    """What saving and loading need from an Accelerator besides the objects it prepared.

    Args:
        process: this process's place in the job (ranks, device, barrier).
        project: checkpoint folder naming and retention; its ``iteration`` is advanced.
        scaler: the fp16 gradient scaler, if any.
        step: the accumulation counter to store with the checkpoint.
        sharded_fsdp: FSDP models are saved as per-rank shards (``SHARDED_STATE_DICT``).
    """

    process: ProcessState
    project: ProjectConfiguration
    scaler: Any = None
    step: int = 0
    sharded_fsdp: bool = False

    @property
    def is_writer(self) -> bool:
        """This process writes shared files: the main process, or each machine's with ``save_on_each_node``."""
        if self.project.save_on_each_node:
            return self.process.is_local_main_process
        return self.process.is_main_process

    def writer_ranks(self) -> tuple[int, ...]:
        """The global ranks that write (see :attr:`is_writer`): gathered states must reach each of them.

        A collective under ``save_on_each_node`` in a multi-process job (each rank tells whether it
        is its machine's local main process); ``(0,)`` otherwise.
        """
        import torch.distributed as dist

        process = self.process
        if not self.project.save_on_each_node or process.num_processes == 1 or not dist.is_initialized():
            return (0,)  # (XLA replicas have no torch.distributed group: their states are not gathered there)

        local_mains: list[Any] = [None] * process.num_processes
        dist.all_gather_object(local_mains, process.is_local_main_process)
        return tuple(rank for rank, main in enumerate(local_mains) if main)


@dataclass(frozen=True)
class LoadedState:
    """What :func:`nbaccel.training.state_loading.load_accelerator_state` read besides the objects' states.

    Args:
        path: the checkpoint folder read.
        step: the accumulation counter stored with it (``None`` in Accelerate's checkpoints).
    """

    path: Path
    step: int | None


def model_state_dict(model: torch.nn.Module, unwrap: bool = True, ranks: tuple[int, ...] = (0,)
                     ) -> dict[str, torch.Tensor]:
    """The model's full state dict on CPU (gathered from the shards under FSDP onto ``ranks``: call on every rank)."""
    from nbaccel.training.fsdp import full_model_state_dict, is_fsdp_model

    if is_fsdp_model(model):
        return full_model_state_dict(model, ranks)
    if is_deepspeed_engine(model):
        return deepspeed_state_dict(model)
    state = (unwrap_model(model, keep_torch_compile=False) if unwrap else model).state_dict()
    return {k: v.cpu() if v.device.type == "xla" else v for k, v in state.items()}


def _automatic_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """``root``'s ``checkpoint_<n>`` folders, oldest (lowest ``n``) first."""
    numbered = ((p.name.split("_")[-1], p) for p in root.glob("checkpoint_*"))
    return sorted((int(n), p) for n, p in numbered if n.isdigit())


def checkpoint_folder(project: ProjectConfiguration, output_dir: str | Path | None, *, for_load: bool) -> Path:
    """The folder to save into / load from, following ``ProjectConfiguration``'s automatic naming."""
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
    for _, candidate in reversed(_automatic_checkpoints(root)):  # the newest complete one
        try:
            resolve_checkpoint(candidate)
        except CheckpointError:
            continue
        return candidate
    raise CheckpointError(f"no automatic checkpoint under {str(root)!r} is complete; save one with save_state() first",
                          path=str(root))


def _prune(context: CheckpointContext) -> None:
    """Keep only ``total_limit`` automatic checkpoints (oldest removed first).

    Run after the new checkpoint is complete, not before as Accelerate does: a crash mid-save then
    never leaves fewer complete checkpoints than there were.
    """
    project = context.project
    if (not project.automatic_checkpoint_naming or project.total_limit is None or project.project_dir is None
            or not context.is_writer):
        return
    root = Path(project.project_dir) / "checkpoints"
    found = _automatic_checkpoints(root)
    for _, old in found[: max(len(found) - project.total_limit, 0)]:
        remove_checkpoint(old)


def _optimizer_state(prepared: PreparedObjects, context: CheckpointContext, index: int, optimizer: Any,
                     writers: tuple[int, ...]) -> Any:
    from nbaccel.training.fsdp import full_optimizer_state_dict, is_fsdp_model

    if index < len(prepared.models) and is_fsdp_model(prepared.models[index]):
        return full_optimizer_state_dict(prepared.models[index], optimizer.optimizer, writers)
    state = optimizer.state_dict()
    if context.process.device.type == "xla":
        from nbaccel.nested_data import send_to_device

        state = send_to_device(state, torch.device("cpu"))
    return state


def engine_owned(obj: Any) -> bool:
    """Whether a DeepSpeed engine saves and loads ``obj`` with the model."""
    return isinstance(obj, (DeepSpeedOptimizerWrapper, DeepSpeedSchedulerWrapper))


def _write_models(prepared: PreparedObjects, context: CheckpointContext, tmp: Path, safe_serialization: bool,
                  writers: tuple[int, ...]) -> None:
    from nbaccel.training.fsdp import is_fsdp_model, sharded_save

    weights = []
    for i, model in enumerate(prepared.models):
        if is_deepspeed_engine(model):  # model, optimizer and scheduler, every rank its own shards
            cast(Any, model).save_checkpoint(str(tmp), tag=CHECKPOINT_TAG)  # DeepSpeed's engine: no type information
        elif context.sharded_fsdp and is_fsdp_model(model):
            optimizer = prepared.optimizer_for(i)
            sharded_save(model, optimizer.optimizer if optimizer is not None else None, tmp / f"pytorch_model_fsdp_{i}")
        else:
            weights.append(model_state_dict(model, ranks=writers))
    for hook in list(prepared.save_state_pre_hooks.values()):  # may drop entries of `weights` to save them itself
        hook(list(prepared.models), weights, str(tmp))
    if context.is_writer:
        stem, ext = ("model", "safetensors") if safe_serialization else ("pytorch_model", "bin")
        for i, state in enumerate(weights):  # numbered in order, as Accelerate does after its hooks
            write_weights(state, tmp / numbered_name(stem, i, ext), safe_serialization)


def _save_custom_state(obj: Any, path: Path) -> None:
    """Write a registered object's state, warning when ``load_state`` would refuse it by default."""
    from nbaccel.safe_load import OPT_IN, load_state_file

    torch.save(obj.state_dict(), path)
    try:
        load_state_file(path)
    except UnsafeCheckpointError as exc:
        warnings.warn(f"{type(obj).__name__}.state_dict() holds more than tensors and plain Python values, so "
                      f"load_state will refuse {path.name} unless it opts in with {OPT_IN}: {exc}. Fix: return only "
                      "tensors, numbers, strings, lists and dicts from state_dict()", stacklevel=6)


def _write_state(prepared: PreparedObjects, context: CheckpointContext, tmp: Path, safe_serialization: bool) -> None:
    from nbaccel.training.fsdp import is_fsdp_model

    writer = context.is_writer
    writers = context.writer_ranks() if any(is_fsdp_model(m) for m in prepared.models) else (0,)
    _write_models(prepared, context, tmp, safe_serialization, writers)
    for i, optimizer in enumerate(prepared.optimizers):
        if ((context.sharded_fsdp and i < len(prepared.models) and is_fsdp_model(prepared.models[i]))
                or engine_owned(optimizer)):
            continue
        state = _optimizer_state(prepared, context, i, optimizer, writers)
        if writer:
            torch.save(state, tmp / numbered_name("optimizer", i, "bin"))
    if writer:
        for i, scheduler in enumerate(prepared.schedulers):
            if not engine_owned(scheduler):
                torch.save(scheduler.state_dict(), tmp / numbered_name("scheduler", i, "bin"))
        for i, loader in enumerate(prepared.dataloaders):
            if callable(getattr(loader, "state_dict", None)):
                torch.save(loader.state_dict(), tmp / numbered_name("sampler", i, "bin"))
        if context.scaler is not None:
            torch.save(context.scaler.state_dict(), tmp / "scaler.pt")
        for i, obj in enumerate(prepared.custom_objects):
            _save_custom_state(obj, tmp / f"custom_checkpoint_{i}.pkl")
    torch.save(capture_rng_state(), tmp / f"random_states_{context.process.process_index}.pkl")


def save_accelerator_state(prepared: PreparedObjects, context: CheckpointContext, output_dir: str | Path | None,
                           safe_serialization: bool = True) -> Path:
    """Write the training state into ``output_dir`` atomically (see :mod:`nbaccel.training.checkpointing`).

    Raises:
        ConfigError: no folder was given and automatic naming is off.
        CheckpointError: the automatically named folder exists already.
    """
    project = context.project
    folder = checkpoint_folder(project, output_dir, for_load=False)
    summary = {"format": "nbaccel-training-state", "version": 1, "num_processes": context.process.num_processes,
               "models": len(prepared.models), "optimizers": len(prepared.optimizers),
               "schedulers": len(prepared.schedulers), "dataloaders": len(prepared.dataloaders),
               "custom_objects": len(prepared.custom_objects), "step": context.step}
    save_state_folder(folder, lambda tmp: _write_state(prepared, context, tmp, safe_serialization),
                      barrier=context.process.wait_for_everyone, is_writer=context.is_writer, summary=summary)
    if project.automatic_checkpoint_naming and output_dir is None:
        project.iteration += 1
    _prune(context)
    return folder
