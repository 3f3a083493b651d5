"""`Accelerator`: Hugging Face Accelerate's training API, working inside nbaccel's workers.

With no arguments it reads the job from the environment (:class:`~nbaccel.partial_state.AcceleratorState`):
inside a 4-process CPU launch it trains as one 4-process gloo job. ``prepare`` places models
(DDP across processes, FSDP2 when configured, autocast for mixed precision), wraps optimizers,
schedulers and dataloaders, and returns them in the order given. Collectives and
per-process helpers come from :class:`~nbaccel.process_helpers.ProcessHelpers`; saving and
loading from :class:`~nbaccel.checkpoint_helpers.CheckpointHelpers`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from nbaccel.checkpoint_helpers import CheckpointHelpers
from nbaccel.data_loader import DataLoaderShard, XlaDeviceLoader, prepare_data_loader, skip_first_batches
from nbaccel.environment import MixedPrecision
from nbaccel.errors import ConfigError
from nbaccel.gradient_state import GradientState
from nbaccel.optimizer import AcceleratedOptimizer
from nbaccel.partial_state import AcceleratorState
from nbaccel.plugins import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProjectConfiguration,
    collect_handlers,
    resolve_accumulation_plugin,
    resolve_dataloader_config,
    resolve_deepspeed_plugin,
)
from nbaccel.precision import autocast_context, make_grad_scaler, unwrap_forward, validate_mixed_precision, wrap_forward
from nbaccel.process_helpers import ProcessHelpers
from nbaccel.scheduler import AcceleratedScheduler
from nbaccel.state import DistributedType

__all__ = ["Accelerator"]

class Accelerator(ProcessHelpers, CheckpointHelpers):
    """Accelerate's ``Accelerator``: one object that makes a training loop distributed.

    Args:
        device_placement: move prepared models and batches to :attr:`device`.
        split_batches: shorthand for ``DataLoaderConfiguration(split_batches=...)``.
        mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"``; default: the launch's setting.
        gradient_accumulation_steps: micro-batches per optimizer step.
        cpu: run on CPU even where accelerators exist.
        dataloader_config: how dataloaders are split, padded and seeded.
        deepspeed_plugin: DeepSpeed settings (needs the ``deepspeed`` package).
        fsdp_plugin: FSDP2 settings; default: the launch's ``fsdp_config`` when it chose FSDP.
        rng_types: accepted for compatibility; shuffling is always synchronized from rank 0.
        log_with: accepted for compatibility; experiment trackers are not part of nbaccel.
        project_dir: shorthand for ``ProjectConfiguration(project_dir=...)``.
        project_config: where checkpoints go and how many are kept.
        gradient_accumulation_plugin: full accumulation settings (instead of the steps count).
        step_scheduler_with_optimizer: step schedulers with the optimizer (Accelerate's rule).
        kwargs_handlers: ``DistributedDataParallelKwargs``, ``GradScalerKwargs``,
            ``AutocastKwargs``, ``InitProcessGroupKwargs`` instances.
        even_batches: shorthand for ``DataLoaderConfiguration(even_batches=...)``.
        dispatch_batches: shorthand for ``DataLoaderConfiguration(dispatch_batches=...)``.

    Raises:
        ConfigError: an argument has an invalid value or conflicts with another.
        MissingDependencyError: DeepSpeed was asked for but is not installed.

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
                 even_batches: bool | None = None, dispatch_batches: bool | None = None) -> None:
        handlers = collect_handlers(kwargs_handlers)
        init_kwargs = handlers.get(InitProcessGroupKwargs, InitProcessGroupKwargs())
        self.state = AcceleratorState(cpu=cpu, backend=init_kwargs.backend, timeout=init_kwargs.timeout)
        settings = self.state.settings
        self._mixed_precision = validate_mixed_precision(mixed_precision or self.state.mixed_precision)
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
        if self.fsdp_plugin is not None and self._mixed_precision != "no":
            self.fsdp_plugin.set_mixed_precision(self._mixed_precision)
        self.scaler = make_grad_scaler(self._mixed_precision, self.device, self.scaler_handler)
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.rng_types = rng_types
        if log_with is not None:
            warnings.warn(f"log_with={log_with!r} is ignored: nbaccel has no experiment trackers; "
                          "log with the tracker's own API on the main process", stacklevel=2)
        self.log_with = log_with
        self.step = 0
        self._models: list[torch.nn.Module] = []
        self._optimizers: list[AcceleratedOptimizer] = []
        self._schedulers: list[AcceleratedScheduler] = []
        self._dataloaders: list[Any] = []
        self._custom_objects: list[Any] = []
        self._save_state_pre_hooks = OrderedDict()
        self._load_state_pre_hooks = OrderedDict()
        self._trigger = False

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
        return any(opt.step_was_skipped for opt in self._optimizers)

    @property
    def project_dir(self) -> str | None:
        return self.project_configuration.project_dir

    @property
    def save_iteration(self) -> int:
        return self.project_configuration.iteration

    # ------------------------------------------------------------------ prepare
    def prepare(self, *args: Any, device_placement: list[bool | None] | None = None) -> Any:
        """Prepare models, optimizers, dataloaders and schedulers; returns them in the order given.

        Raises:
            ConfigError: ``device_placement`` does not have one entry per argument.

        Example:
            >>> model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)   # doctest: +SKIP
        """
        if device_placement is None:
            device_placement = [None] * len(args)
        elif len(device_placement) != len(args):
            raise ConfigError(f"`device_placement` needs one entry per object passed to prepare ({len(args)}), got "
                              f"{len(device_placement)}", key="device_placement", value=device_placement,
                              valid=f"a list of {len(args)} bools or None")
        if self.deepspeed_plugin is not None:
            from nbaccel.deepspeed_engine import prepare_deepspeed

            result = prepare_deepspeed(self, args)
            return result[0] if len(result) == 1 else tuple(result)
        result = list(args)
        optimizers = [o for o in args if isinstance(o, torch.optim.Optimizer) and not isinstance(o, AcceleratedOptimizer)]
        order = (torch.nn.Module, torch.optim.Optimizer, DataLoader, torch.optim.lr_scheduler.LRScheduler)
        for kind in order:
            for i, obj in enumerate(args):
                if isinstance(obj, kind) and not _is_prepared(obj):
                    result[i] = self._prepare_one(obj, device_placement[i], optimizers)
        return result[0] if len(result) == 1 else tuple(result)

    def _prepare_one(self, obj: Any, placement: bool | None, optimizers: list[torch.optim.Optimizer]) -> Any:
        if isinstance(obj, torch.nn.Module):
            return self.prepare_model(obj, device_placement=placement, _optimizers=optimizers)
        if isinstance(obj, torch.optim.Optimizer):
            return self.prepare_optimizer(obj, device_placement=placement)
        if isinstance(obj, DataLoader):
            return self.prepare_data_loader(obj, device_placement=placement)
        return self.prepare_scheduler(obj)

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False, _optimizers: list[torch.optim.Optimizer] | None = None
                      ) -> torch.nn.Module:
        """Place ``model`` on the device, wrap it for the job (DDP / FSDP2) and for mixed precision.

        Args:
            model: the model.
            device_placement: override the accelerator's ``device_placement``.
            evaluation_mode: no DDP wrapper (inference only).

        Example:
            >>> model = accelerator.prepare_model(torch.nn.Linear(4, 2))   # doctest: +SKIP
        """
        if self.deepspeed_plugin is not None:
            from nbaccel.deepspeed_engine import prepare_deepspeed

            return prepare_deepspeed(self, (model,))[0]
        place = self.device_placement if device_placement is None else device_placement
        if place and not (self.fsdp_plugin is not None and self.fsdp_plugin.cpu_offload):
            before = list(model.parameters()) if self.device.type == "xla" else []
            model = model.to(self.device)
            if before:  # XLA: .to() makes new Parameter objects; the optimizers must follow them
                _switch_parameters(before, list(model.parameters()),
                                   list(_optimizers or []) + [o.optimizer for o in self._optimizers])
        if self._mixed_precision != "no":
            wrap_forward(model, self._mixed_precision, self.device, self.autocast_handler)
        trainable = any(p.requires_grad for p in model.parameters())
        if self.fsdp_plugin is not None and not evaluation_mode:
            from nbaccel.fsdp import shard_model

            optimizers = list(_optimizers or []) + [o.optimizer for o in self._optimizers]
            model = shard_model(model, self.fsdp_plugin, self.device, self.num_processes, optimizers,
                                upcast=self._mixed_precision != "no")
        elif self.num_processes > 1 and trainable and not evaluation_mode and self.device.type == "xla":
            _broadcast_xla_weights(model)
        elif self.num_processes > 1 and trainable and not evaluation_mode:
            kwargs = self.ddp_handler.to_kwargs()
            if self.device.type == "cuda":
                kwargs.update(device_ids=[self.device.index], output_device=self.device.index)
            model = torch.nn.parallel.DistributedDataParallel(model, **kwargs)
        self._models.append(model)
        return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
                          ) -> AcceleratedOptimizer:
        """Wrap ``optimizer`` so it steps only when gradients are synchronized (through the scaler for fp16)."""
        place = self.device_placement if device_placement is None else device_placement
        wrapped = AcceleratedOptimizer(optimizer, device_placement=place, scaler=self.scaler,
                                       gradient_state=self.gradient_state, device=self.device)
        self._optimizers.append(wrapped)
        return wrapped

    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        """Wrap ``scheduler`` so it steps with its optimizer, Accelerate's way."""
        optimizer = next((o for o in self._optimizers if o.optimizer is scheduler.optimizer), scheduler.optimizer)
        wrapped = AcceleratedScheduler(scheduler, optimizer, step_with_optimizer=self.step_scheduler_with_optimizer,
                                       split_batches=self.split_batches, num_processes=self.num_processes,
                                       gradient_state=self.gradient_state)
        self._schedulers.append(wrapped)
        return wrapped

    def prepare_data_loader(self, data_loader: DataLoader, device_placement: bool | None = None) -> Any:
        """Shard ``data_loader`` across processes and move its batches to the device."""
        place = self.device_placement if device_placement is None else device_placement
        loader: Any = prepare_data_loader(data_loader, self.device if place else None, self.num_processes,
                                          self.process_index, self.dataloader_config, self.gradient_state)
        if place and self.device.type == "xla":
            loader = XlaDeviceLoader(loader, self.device)
        self._dataloaders.append(loader)
        return loader

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """A prepared loader that starts after its first ``num_batches`` batches (to resume mid-epoch).

        Example:
            >>> accelerator.load_state("ckpt")                                # doctest: +SKIP
            >>> loader = accelerator.skip_first_batches(train_loader, 30)     # doctest: +SKIP
        """
        inner = dataloader._loader if isinstance(dataloader, XlaDeviceLoader) else dataloader
        skipped = skip_first_batches(inner, num_batches)
        return XlaDeviceLoader(skipped, self.device) if isinstance(dataloader, XlaDeviceLoader) else skipped

    # ------------------------------------------------------------------ training step
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, divided by the accumulation steps and scaled for fp16.

        Example:
            >>> accelerator.backward(loss)   # doctest: +SKIP
        """
        if self.deepspeed_engine is not None:
            from nbaccel.deepspeed_engine import backward

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
        if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)
            return
        yield

    @contextlib.contextmanager
    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> Iterator[None]:
        """Run the block under this accelerator's mixed precision (for code outside the model)."""
        with autocast_context(self._mixed_precision, self.device, autocast_handler or self.autocast_handler):
            yield

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Divide gradients by the fp16 loss scale (done for you by the ``clip_grad_*`` methods)."""
        targets = self._optimizers if optimizer is None else (optimizer if isinstance(optimizer, list) else [optimizer])
        for opt in targets:
            if isinstance(opt, AcceleratedOptimizer):
                opt.unscale_()

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor | None:
        """Clip the total gradient norm (after unscaling fp16 gradients); returns the norm before clipping.

        Under DeepSpeed the engine clips (set ``gradient_clipping`` in its config); this returns
        the engine's last global gradient norm (``None`` before its first step).

        Example:
            >>> if accelerator.sync_gradients:                                   # doctest: +SKIP
            ...     accelerator.clip_grad_norm_(model.parameters(), 1.0)
        """
        if self.deepspeed_engine is not None:
            norm = self.deepspeed_engine.get_global_grad_norm()
            return None if norm is None else torch.as_tensor(float(norm))
        parameters = [p for p in parameters if p.grad is not None] if not torch.is_tensor(parameters) else [parameters]
        self._xla_sync_gradients(parameters)
        self.unscale_gradients()
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Clip each gradient to ``[-clip_value, clip_value]`` (after unscaling fp16 gradients)."""
        parameters = [p for p in parameters if p.grad is not None] if not torch.is_tensor(parameters) else [parameters]
        self._xla_sync_gradients(parameters)
        self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    def _xla_sync_gradients(self, parameters: list[torch.Tensor]) -> None:
        """On XLA, all-reduce gradients before clipping (the optimizer step then skips its own reduce)."""
        if self.device.type != "xla" or self.num_processes == 1 or self.gradient_state.is_xla_gradients_synced:
            return
        import torch_xla.core.xla_model as xm

        xm.all_reduce("sum", [p.grad for p in parameters], scale=1.0 / self.num_processes)
        self.gradient_state.is_xla_gradients_synced = True

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
        from nbaccel.deepspeed_engine import is_deepspeed_engine

        compiled: torch.nn.Module | None = None
        while True:
            if isinstance(model, torch.nn.parallel.DistributedDataParallel) or is_deepspeed_engine(model):
                compiled = None  # a compile wrapper around DDP cannot be kept without the DDP inside it
                model = model.module
            elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
                compiled = model if compiled is None else compiled
                model = model._orig_mod
            else:
                break
        if not keep_fp32_wrapper:
            unwrap_forward(model)
        return compiled if keep_torch_compile and compiled is not None else model

    # ------------------------------------------------------------------ housekeeping
    def free_memory(self, *objects: Any) -> list[None]:
        """Drop references to everything prepared (and return ``None`` for each of ``objects``)."""
        self._models.clear()
        self._optimizers.clear()
        self._schedulers.clear()
        self._dataloaders.clear()
        self.step = 0
        import gc

        gc.collect()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        return [None for _ in objects]

    clear = free_memory

    def init_trackers(self, project_name: str, config: dict[str, Any] | None = None,
                      init_kwargs: dict[str, Any] | None = None) -> None:
        """Accepted for compatibility; nbaccel has no experiment trackers."""

    def log(self, values: dict[str, Any], step: int | None = None, log_kwargs: dict[str, Any] | None = None) -> None:
        """Accepted for compatibility; nbaccel has no experiment trackers."""

    def end_training(self) -> None:
        """Wait for every process (trackers would be closed here)."""
        self.wait_for_everyone()

    def __repr__(self) -> str:
        return (f"Accelerator(distributed_type={str(self.distributed_type)!r}, num_processes={self.num_processes}, "
                f"process_index={self.process_index}, device={self.device}, mixed_precision={self.mixed_precision!r}, "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps})")


def _switch_parameters(old: list[torch.nn.Parameter], new: list[torch.nn.Parameter],
                       optimizers: list[torch.optim.Optimizer]) -> None:
    """Point ``optimizers`` (param groups and state) at ``new`` where they held ``old`` (same order)."""
    moved = {id(o): n for o, n in zip(old, new) if o is not n}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [moved.get(id(p), p) for p in group["params"]]
        for param in [p for p in optimizer.state if id(p) in moved]:
            optimizer.state[moved[id(param)]] = optimizer.state.pop(param)


def _is_prepared(obj: Any) -> bool:
    return isinstance(obj, (AcceleratedOptimizer, AcceleratedScheduler, DataLoaderShard))


def _broadcast_xla_weights(model: torch.nn.Module) -> None:
    """Give every XLA replica replica 0's parameters and buffers, as DDP does at construction.

    Replicas that run as threads of one process (TPU v2/v3) share torch's CPU generator, so
    ``manual_seed`` in each does not give them the same initial weights; no wrapper syncs them.
    """
    import torch_xla.core.xla_model as xm

    xm.broadcast_master_param(model)
    from nbaccel.optimizer import _xla_sync

    _xla_sync()
