"""DeepSpeed: build the engine in ``prepare``, and the thin wrappers that let the engine step.

Used only where the ``deepspeed`` package is installed (the Accelerator checks that first).
As in Accelerate, ``"auto"`` values of the DeepSpeed config are filled from what nbaccel knows
(micro-batch size from the dataloader, accumulation steps, mixed precision), the engine owns the
optimizer and scheduler steps, and ``Accelerator.backward`` runs ``engine.backward`` then
``engine.step`` on accumulation boundaries. So ``optimizer.step()`` and ``scheduler.step()`` in
the user's loop are no-ops, exactly as in Accelerate.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from nbaccel.environment import apply_environment, single_process_environment
from nbaccel.errors import ConfigError
from nbaccel.identity import current_identity
from nbaccel.process_state import ProcessState
from nbaccel.training.gradient_state import GradientState
from nbaccel.training.optimizer import AcceleratedOptimizer
from nbaccel.training.prepared import PreparedObjects, is_prepared
from nbaccel.training.scheduler import AcceleratedScheduler

__all__ = ["CHECKPOINT_TAG", "DeepSpeedOptimizerWrapper", "DeepSpeedPrepared", "DeepSpeedSchedulerWrapper",
           "backward", "build_config", "is_deepspeed_engine", "prepare_deepspeed", "state_dict"]

CHECKPOINT_TAG = "pytorch_model"


def is_deepspeed_engine(model: Any) -> bool:
    """Whether ``model`` is a ``deepspeed.DeepSpeedEngine`` (without importing deepspeed)."""
    module = sys.modules.get("deepspeed")
    return module is not None and isinstance(model, module.DeepSpeedEngine)


class DeepSpeedOptimizerWrapper(AcceleratedOptimizer):
    """The engine's optimizer: ``step`` and ``zero_grad`` are the engine's job, so they do nothing here."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """No-op: the engine clears gradients when it steps."""

    def step(self, closure: Any = None) -> None:  # type: ignore[override]  # the engine steps without a closure
        """No-op: ``Accelerator.backward`` steps the engine."""

    @property
    def step_was_skipped(self) -> bool:
        """Whether the engine skipped its last step (fp16 overflow)."""
        return bool(getattr(self.optimizer, "overflow", False))


class DeepSpeedSchedulerWrapper(AcceleratedScheduler):
    """The engine's scheduler: stepped by the engine, so ``step`` does nothing here."""

    def step(self, *args: Any, **kwargs: Any) -> None:
        """No-op: the engine steps the scheduler with the optimizer."""


def build_config(base: dict[str, Any], *, micro_batch_size: int | None, accumulation_steps: int,
                 num_processes: int, mixed_precision: str, zero_optimizer: bool) -> dict[str, Any]:
    """Fill the ``"auto"`` (or missing) entries of a DeepSpeed config from nbaccel's settings.

    Example:
        >>> build_config({}, micro_batch_size=8, accumulation_steps=2, num_processes=2, mixed_precision="no",
        ...              zero_optimizer=False)["train_batch_size"]
        32
    """
    config = copy.deepcopy(base)

    def fill(key: str, value: Any) -> None:
        if config.get(key, "auto") == "auto":
            config[key] = value

    micro = micro_batch_size or (config.get("train_micro_batch_size_per_gpu") if
                                 config.get("train_micro_batch_size_per_gpu") != "auto" else None) or 1
    fill("train_micro_batch_size_per_gpu", micro)
    fill("gradient_accumulation_steps", accumulation_steps)
    fill("train_batch_size", config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"]
         * num_processes)
    if config.get("gradient_clipping", "auto") == "auto":
        config["gradient_clipping"] = 0.0  # no clipping unless asked, as without DeepSpeed (its default is 1.0)
    for name in ("fp16", "bf16"):
        section = config.setdefault(name, {})
        if section.get("enabled", "auto") == "auto":
            section["enabled"] = mixed_precision == name
    zero = config.setdefault("zero_optimization", {})
    zero.setdefault("stage", 0)
    if zero["stage"] == 3:
        zero.setdefault("stage3_gather_16bit_weights_on_model_save", True)
    if zero_optimizer and zero["stage"] > 0:
        config.setdefault("zero_allow_untested_optimizer", True)
    return config


@dataclass(frozen=True)
class DeepSpeedPrepared:
    """What :func:`prepare_deepspeed` made.

    Args:
        objects: the arguments of ``prepare``, each replaced by its prepared form, in order.
        engine: the ``DeepSpeedEngine`` (``None`` when no model was passed).
        config: the DeepSpeed config the engine was built with, ``"auto"`` values filled.
    """

    objects: list[Any]
    engine: Any = None
    config: dict[str, Any] | None = None


def prepare_deepspeed(args: tuple[Any, ...], prepared: PreparedObjects, *, base_config: Mapping[str, Any],
                      process: ProcessState, gradient_state: GradientState, mixed_precision: str,
                      split_batches: bool, prepare_data_loader: Callable[[DataLoader], Any]) -> DeepSpeedPrepared:
    """``prepare`` under DeepSpeed: dataloaders as usual, the model, optimizer and scheduler as one engine.

    Objects prepared already pass through unchanged; what is made is recorded in ``prepared``.

    Args:
        args: the objects given to ``prepare``.
        prepared: the Accelerator's registry.
        base_config: the plugin's DeepSpeed config (``"auto"`` values allowed).
        process: this process's place in the job (a process group is joined if none is).
        gradient_state: the Accelerator's accumulation state (its steps fill the config).
        mixed_precision: the Accelerator's mixed precision (fills ``fp16``/``bf16``).
        split_batches: the dataloader's batch is split across processes (micro batch = batch / processes).
        prepare_data_loader: the Accelerator's own dataloader preparation.

    Raises:
        ConfigError: more than one model, or more than one optimizer, is passed.
    """
    result = list(args)
    fresh = [(i, o) for i, o in enumerate(args) if not is_prepared(o)]
    models = [i for i, o in fresh if isinstance(o, torch.nn.Module)]
    optimizers = [i for i, o in fresh if isinstance(o, torch.optim.Optimizer)]
    schedulers = [i for i, o in fresh if isinstance(o, torch.optim.lr_scheduler.LRScheduler)]
    if len(models) > 1 or len(optimizers) > 1:
        raise ConfigError(f"DeepSpeed trains one model with one optimizer per prepare (got {len(models)} models, "
                          f"{len(optimizers)} optimizers); prepare them in separate Accelerators",
                          key="prepare", value=(len(models), len(optimizers)), valid="at most 1 of each")
    loaders = [o for _, o in fresh if isinstance(o, DataLoader)]
    for i, obj in fresh:
        if isinstance(obj, DataLoader):
            result[i] = prepare_data_loader(obj)
    if not models:
        return DeepSpeedPrepared(result)
    import deepspeed  # after the argument checks, which need no deepspeed

    micro = loaders[0].batch_size if loaders else None
    if micro and split_batches:
        micro //= process.num_processes
    optimizer = args[optimizers[0]] if optimizers else None
    scheduler = args[schedulers[0]] if schedulers else None
    config = build_config(dict(base_config), micro_batch_size=micro, accumulation_steps=gradient_state.num_steps,
                          num_processes=process.num_processes, mixed_precision=mixed_precision,
                          zero_optimizer=optimizer is not None)
    _ensure_process_group(process)
    engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(
        model=args[models[0]], optimizer=optimizer, lr_scheduler=scheduler, config=config, dist_init_required=False)
    result[models[0]] = prepared.add("model", engine)
    if optimizers:
        wrapped = DeepSpeedOptimizerWrapper(ds_optimizer, device_placement=False, gradient_state=gradient_state)
        result[optimizers[0]] = prepared.add("optimizer", wrapped)
        if schedulers:
            sched = DeepSpeedSchedulerWrapper(ds_scheduler or scheduler, wrapped, gradient_state=gradient_state)
            result[schedulers[0]] = prepared.add("scheduler", sched)
    return DeepSpeedPrepared(result, engine, config)


def _ensure_process_group(process: ProcessState) -> None:
    """DeepSpeed needs a process group even in one process: join one of size 1 on loopback."""
    dist = torch.distributed
    if dist.is_initialized():
        return
    if current_identity() is None:
        # DeepSpeed reads torchrun's variables itself (LOCAL_RANK above all): give this process a world of one.
        apply_environment(single_process_environment())
    process.init_process_group()


def backward(engine: Any, loss: torch.Tensor, sync_gradients: bool, **kwargs: Any) -> None:
    """``engine.backward`` (it scales by the accumulation steps itself), then ``engine.step`` on a boundary."""
    engine.set_gradient_accumulation_boundary(is_boundary=sync_gradients)
    engine.backward(loss, **kwargs)
    if sync_gradients:
        engine.step()


def state_dict(engine: Any) -> dict[str, torch.Tensor]:
    """The full model state dict (ZeRO-3 gathers 16-bit weights on rank 0: call on every rank)."""
    if engine.zero_optimization_stage() == 3:
        return engine._zero3_consolidated_16bit_state_dict() or {}
    return engine.module.state_dict()
