"""`Accelerator`: Hugging Face Accelerate's training API, working inside nbaccel's workers.

With no arguments it reads the job from the environment (:class:`~nbaccel.partial_state.AcceleratorState`):
inside a 4-process CPU launch it trains as one 4-process gloo job. ``prepare`` places models
(DDP across processes, FSDP2 when configured, autocast for mixed precision), wraps optimizers,
schedulers and dataloaders, and returns them in the order given; what it prepared is kept in
one registry (:class:`~nbaccel.training.prepared.PreparedObjects`, ``accelerator.prepared``), and an
object prepared already comes back unchanged (:class:`~nbaccel.training.preparation.PrepareHelpers`).
Collectives and per-process helpers come from :class:`~nbaccel.training.process_helpers.ProcessHelpers`;
saving and loading from :class:`~nbaccel.training.checkpoint_helpers.CheckpointHelpers`; unscaling and
clipping gradients from :class:`~nbaccel.training.gradient_clipping.GradientClipping`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from nbaccel.distributed_type import DistributedType
from nbaccel.environment import MixedPrecision
from nbaccel.errors import ConfigError
from nbaccel.hardware import check_os_kernel
from nbaccel.partial_state import AcceleratorState
from nbaccel.tracking.helpers import TrackingHelpers
from nbaccel.training.checkpoint_helpers import CheckpointHelpers
from nbaccel.training.gradient_clipping import GradientClipping
from nbaccel.training.gradient_state import GradientState
from nbaccel.training.kwargs_handlers import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
)
from nbaccel.training.plugin_resolution import (
    collect_handlers,
    resolve_accumulation_plugin,
    resolve_dataloader_config,
    resolve_deepspeed_plugin,
)
from nbaccel.training.plugins import (
    DataLoaderConfiguration,
    DeepSpeedPlugin,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    ProjectConfiguration,
)
from nbaccel.training.precision import (
    autocast_context,
    make_grad_scaler,
    validate_mixed_precision,
)
from nbaccel.training.preparation import PrepareHelpers
from nbaccel.training.prepared import PreparedObjects, RegistryView
from nbaccel.training.process_helpers import ProcessHelpers
from nbaccel.training.uneven_inputs import UnevenInputs
from nbaccel.training.unwrap import unwrap_model

__all__ = ["Accelerator"]

class Accelerator(PrepareHelpers, ProcessHelpers, CheckpointHelpers, TrackingHelpers, UnevenInputs,
                  GradientClipping):
    """Accelerate's ``Accelerator``: one object that makes a training loop distributed.

    Args:
        device_placement: move prepared models and batches to :attr:`device`.
        split_batches: shorthand for ``DataLoaderConfiguration(split_batches=...)``.
        mixed_precision: ``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"`` (torchao's Float8Linear on GPUs of
            compute capability 8.9+, as in Accelerate); default: the launch's setting.
        gradient_accumulation_steps: micro-batches per optimizer step.
        cpu: run on CPU even where accelerators exist.
        dataloader_config: how dataloaders are split, padded and seeded.
        deepspeed_plugin: DeepSpeed settings (needs the ``deepspeed`` package).
        fsdp_plugin: FSDP2 settings; default: the launch's ``fsdp_config`` when it chose FSDP.
        rng_types: accepted for compatibility; shuffling is always synchronized from rank 0.
        log_with: trackers: ``"tensorboard"``, ``"mlflow"``, ``"wandb"``, ``"trackio"``, ``"notebook"``,
            ``"all"`` (the installed ones), :class:`~nbaccel.tracking.GeneralTracker` instances, or a
            list (see :mod:`nbaccel.tracking.helpers` for where nbaccel differs from Accelerate).
        project_dir: shorthand for ``ProjectConfiguration(project_dir=...)``.
        project_config: where checkpoints go and how many are kept.
        gradient_accumulation_plugin: full accumulation settings (instead of the steps count).
        step_scheduler_with_optimizer: step schedulers with the optimizer (Accelerate's rule).
        kwargs_handlers: ``DistributedDataParallelKwargs``, ``GradScalerKwargs``,
            ``AutocastKwargs``, ``InitProcessGroupKwargs`` instances.
        even_batches: shorthand for ``DataLoaderConfiguration(even_batches=...)``.
        dispatch_batches: shorthand for ``DataLoaderConfiguration(dispatch_batches=...)``.
        notebook_tracker: inside an nbaccel launch, stream ``log`` to the launching notebook's
            live chart (nbaccel only; Accelerate has no such tracker).

    Attributes:
        prepared: what this Accelerator prepared and registered; ``_models``, ``_optimizers``,
            ``_schedulers``, ``_dataloaders`` and ``_custom_objects`` (Accelerate's names) are
            views of its lists.

    Raises:
        ConfigError: an argument has an invalid value or conflicts with another.
        MissingDependencyError: DeepSpeed, or a tracker named in ``log_with``, is not installed.

    Example:
        >>> accelerator = Accelerator(gradient_accumulation_steps=2)
        >>> model, optimizer, loader = accelerator.prepare(model, optimizer, loader)   # doctest: +SKIP
        >>> for x, y in loader:                                                       # doctest: +SKIP
        ...     with accelerator.accumulate(model):
        ...         accelerator.backward(loss_fn(model(x), y))
        ...         optimizer.step(); optimizer.zero_grad()
    """

    def __init__(self, device_placement: bool = True, split_batches: bool | None = None,
                 mixed_precision: MixedPrecision | None = None, gradient_accumulation_steps: int = 1,
                 cpu: bool = False, dataloader_config: DataLoaderConfiguration | None = None,
                 deepspeed_plugin: DeepSpeedPlugin | None = None,
                 fsdp_plugin: FullyShardedDataParallelPlugin | None = None, rng_types: list[str] | None = None,
                 log_with: Any = None, project_dir: str | None = None,
                 project_config: ProjectConfiguration | None = None,
                 gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
                 step_scheduler_with_optimizer: bool = True, kwargs_handlers: list[KwargsHandler] | None = None,
                 even_batches: bool | None = None, dispatch_batches: bool | None = None,
                 notebook_tracker: bool = True) -> None:
        handlers = collect_handlers(kwargs_handlers)
        init_kwargs = handlers.get(InitProcessGroupKwargs, InitProcessGroupKwargs())
        self.state = AcceleratorState(cpu=cpu, backend=init_kwargs.backend, timeout=init_kwargs.timeout,
                                      cpu_collectives=bool(fsdp_plugin is not None and fsdp_plugin.cpu_offload))
        settings = self.state.settings
        self._mixed_precision = validate_mixed_precision(mixed_precision or self.state.mixed_precision)
        if self._mixed_precision == "fp8":
            from nbaccel.training.fp8 import check_fp8_device

            check_fp8_device(self.state.device)
        self.device_placement = device_placement
        self.dataloader_config = resolve_dataloader_config(dataloader_config, split_batches, even_batches,
                                                           dispatch_batches)
        self.gradient_state = GradientState(resolve_accumulation_plugin(gradient_accumulation_plugin,
                                                                        gradient_accumulation_steps))
        self.project_configuration = project_config or ProjectConfiguration(project_dir=project_dir)
        if project_dir is not None and project_config is not None:
            self.project_configuration.set_directories(project_dir)
        self.ddp_handler = handlers.get(DistributedDataParallelKwargs, DistributedDataParallelKwargs())
        self.autocast_handler = handlers.get(AutocastKwargs, AutocastKwargs())
        self.scaler_handler = handlers.get(GradScalerKwargs, GradScalerKwargs())
        self.deepspeed_plugin = resolve_deepspeed_plugin(deepspeed_plugin, settings)
        if self.deepspeed_plugin is not None and self._mixed_precision == "fp8":
            raise ConfigError("mixed_precision='fp8' is not supported with DeepSpeed in nbaccel (its config has no fp8 "
                              "section, so training would silently run in fp32). Fix: use mixed_precision='bf16' with "
                              "DeepSpeed, or fp8 without it", key="mixed_precision", value="fp8",
                              valid=("no", "fp16", "bf16"))
        self.deepspeed_engine: Any = None
        self.deepspeed_config: dict[str, Any] | None = None
        ds_steps = (self.deepspeed_plugin.deepspeed_config.get("gradient_accumulation_steps")
                    if self.deepspeed_plugin is not None else None)
        if isinstance(ds_steps, int) and gradient_accumulation_steps == 1 and gradient_accumulation_plugin is None:
            self.gradient_state.plugin = GradientAccumulationPlugin(num_steps=ds_steps)
        self.fsdp_plugin = fsdp_plugin or (FullyShardedDataParallelPlugin.from_config(settings.fsdp_config)
                                           if settings.distributed_type == "FSDP" else None)
        if self.fsdp_plugin is not None and self.state.num_processes == 1:
            warnings.warn("FSDP was asked for in a single process; the model is trained unsharded", stacklevel=2)
            self.fsdp_plugin = None
        if self.fsdp_plugin is not None and self._mixed_precision != "no":  # fp8: the non-fp8 parts run in bf16
            self.fsdp_plugin.set_mixed_precision("bf16" if self._mixed_precision == "fp8" else self._mixed_precision)
        self.scaler = make_grad_scaler(self._mixed_precision, self.device, self.scaler_handler)
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.rng_types = rng_types
        self._setup_tracking(log_with, notebook_tracker)
        self.step = 0
        self.prepared = PreparedObjects()
        self._trigger = False
        if self.state.is_local_main_process:  # Accelerate checks on every Accelerator it makes
            check_os_kernel()

    # Accelerate's private names for what was prepared, read by user code and libraries.
    _models = RegistryView("models")
    _optimizers = RegistryView("optimizers")
    _schedulers = RegistryView("schedulers")
    _dataloaders = RegistryView("dataloaders")
    _custom_objects = RegistryView("custom_objects")
    _save_model_state_pre_hook = RegistryView("save_state_pre_hooks")
    _load_model_state_pre_hook = RegistryView("load_state_pre_hooks")

    # ------------------------------------------------------------------ state
    @property
    def device(self) -> torch.device:
        """Where prepared models and batches live."""
        return self.state.device

    @property
    def distributed_type(self) -> DistributedType:
        """``"NO"``, ``"MULTI_CPU"``, ``"MULTI_GPU"``, ``"FSDP"``, ``"DEEPSPEED"`` or ``"XLA"``."""
        if self.deepspeed_plugin is not None:
            return DistributedType.DEEPSPEED
        if self.fsdp_plugin is not None:
            return DistributedType.FSDP
        return self.state.distributed_type

    @property
    def num_processes(self) -> int:
        return self.state.num_processes

    @property
    def process_index(self) -> int:
        return self.state.process_index

    @property
    def local_process_index(self) -> int:
        return self.state.local_process_index

    @property
    def is_main_process(self) -> bool:
        return self.state.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.state.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return self.state.is_last_process

    @property
    def use_distributed(self) -> bool:
        return self.state.use_distributed

    @property
    def mixed_precision(self) -> MixedPrecision:
        return self._mixed_precision

    @property
    def split_batches(self) -> bool:
        return self.dataloader_config.split_batches

    @property
    def even_batches(self) -> bool:
        return self.dataloader_config.even_batches

    @property
    def sync_gradients(self) -> bool:
        """Whether this step synchronizes gradients (and the optimizer really steps)."""
        return self.gradient_state.sync_gradients

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        self.gradient_state.plugin = GradientAccumulationPlugin(
            num_steps=steps, adjust_scheduler=self.gradient_state.adjust_scheduler,
            sync_with_dataloader=self.gradient_state.sync_with_dataloader,
            sync_each_batch=self.gradient_state.sync_each_batch)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether any prepared optimizer skipped its last step (fp16 overflow)."""
        return any(opt.step_was_skipped for opt in self.prepared.optimizers)

    @property
    def project_dir(self) -> str | None:
        return self.project_configuration.project_dir

    @property
    def save_iteration(self) -> int:
        return self.project_configuration.iteration

    # ------------------------------------------------------------------ training step
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, divided by the accumulation steps and scaled for fp16.

        Example:
            >>> accelerator.backward(loss)   # doctest: +SKIP
        """
        if self.deepspeed_engine is not None:
            from nbaccel.training.deepspeed_engine import backward

            backward(self.deepspeed_engine, loss, self.sync_gradients, **kwargs)
            return
        if self.gradient_accumulation_steps > 1:
            loss = loss / self.gradient_accumulation_steps
        if self.scaler is not None:
            self.scaler.scale(loss).backward(**kwargs)
        else:
            loss.backward(**kwargs)

    def _do_sync(self) -> None:
        state = self.gradient_state
        if state.sync_with_dataloader and state.end_of_dataloader:
            self.step = 0
            state._set_sync_gradients(True)
        else:
            self.step += 1
            state._set_sync_gradients(self.step % state.num_steps == 0)

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module) -> Iterator[None]:
        """Accumulate gradients over ``gradient_accumulation_steps`` batches (no sync in between).

        Example:
            >>> with accelerator.accumulate(model):   # doctest: +SKIP
            ...     accelerator.backward(loss); optimizer.step(); optimizer.zero_grad()
        """
        self._do_sync()
        allow = self.sync_gradients or self.gradient_state.sync_each_batch
        with contextlib.ExitStack() as stack:
            for model in models:
                stack.enter_context(contextlib.nullcontext() if allow else self.no_sync(model))
            yield

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        """Skip the gradient all-reduce for the backward passes in this block (DDP, FSDP2)."""
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            with model.no_sync():
                yield
            return
        set_sync = getattr(model, "set_requires_gradient_sync", None)  # FSDP2 (FSDPModule)
        if set_sync is not None:
            set_sync(False)
            try:
                yield
            finally:
                set_sync(True)
            return
        yield

    @contextlib.contextmanager
    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> Iterator[None]:
        """Run the block under this accelerator's mixed precision (for code outside the model)."""
        with autocast_context(self._mixed_precision, self.device, autocast_handler or self.autocast_handler):
            yield

    # ------------------------------------------------------------------ models and checkpoints
    def unwrap_model(self, model: torch.nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> torch.nn.Module:
        """The model without the DDP / DeepSpeed wrappers ``prepare`` added.

        Args:
            model: a prepared model.
            keep_fp32_wrapper: keep the mixed-precision forward (autocast, fp32 outputs).
            keep_torch_compile: return the ``torch.compile`` wrapper when one wraps the model
                itself; ``False`` returns the plain module under it.

        Example:
            >>> accelerator.unwrap_model(model).state_dict()   # doctest: +SKIP
        """
        return unwrap_model(model, keep_fp32_wrapper=keep_fp32_wrapper, keep_torch_compile=keep_torch_compile)

    # ------------------------------------------------------------------ housekeeping
    def free_memory(self, *objects: Any) -> list[None]:
        """Drop references to everything prepared (and return ``None`` for each of ``objects``)."""
        self.prepared.clear()
        self.step = 0
        import gc

        gc.collect()
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        return [None for _ in objects]

    clear = free_memory

    def __repr__(self) -> str:
        return (f"Accelerator(distributed_type={str(self.distributed_type)!r}, num_processes={self.num_processes}, "
                f"process_index={self.process_index}, device={self.device}, mixed_precision={self.mixed_precision!r}, "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps})")
