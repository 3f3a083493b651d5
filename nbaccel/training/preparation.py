"""The Accelerator's ``prepare``: models placed and wrapped, optimizers, schedulers and loaders wrapped, all recorded.

A mixin of :class:`~nbaccel.Accelerator`, kept apart so that module stays about the training
step. Everything made here is recorded in the Accelerator's one registry
(:class:`~nbaccel.training.prepared.PreparedObjects`, ``self.prepared``) and marked, so an object that
was prepared already comes back unchanged (no DDP inside DDP, nothing listed twice).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from nbaccel.environment import MixedPrecision
from nbaccel.errors import ConfigError
from nbaccel.process_state import ProcessState
from nbaccel.training.gradient_state import GradientState
from nbaccel.training.kwargs_handlers import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
)
from nbaccel.training.loader_preparation import prepare_data_loader, skip_first_batches
from nbaccel.training.optimizer import AcceleratedOptimizer
from nbaccel.training.plugins import (
    DataLoaderConfiguration,
    DeepSpeedPlugin,
    FullyShardedDataParallelPlugin,
)
from nbaccel.training.precision import wrap_forward
from nbaccel.training.prepared import PreparedObjects, is_prepared, kind_of
from nbaccel.training.scheduler import AcceleratedScheduler
from nbaccel.training.xla_loader import XlaDeviceLoader

__all__ = ["PrepareHelpers"]


class PrepareHelpers:
    """Mixin: ``prepare`` and its per-kind steps (see the module docstring)."""

    state: ProcessState
    prepared: PreparedObjects
    device_placement: bool
    dataloader_config: DataLoaderConfiguration
    gradient_state: GradientState
    ddp_handler: DistributedDataParallelKwargs
    autocast_handler: AutocastKwargs
    deepspeed_plugin: DeepSpeedPlugin | None
    deepspeed_engine: Any
    deepspeed_config: dict[str, Any] | None
    fsdp_plugin: FullyShardedDataParallelPlugin | None
    scaler: Any
    step_scheduler_with_optimizer: bool

    if TYPE_CHECKING:  # read-only properties of the Accelerator; declared here for the type checker only
        @property
        def device(self) -> torch.device: ...
        @property
        def mixed_precision(self) -> MixedPrecision: ...
        @property
        def num_processes(self) -> int: ...
        @property
        def process_index(self) -> int: ...
        @property
        def split_batches(self) -> bool: ...

    def prepare(self, *args: Any, device_placement: list[bool | None] | None = None) -> Any:
        """Prepare models, optimizers, dataloaders and schedulers; returns them in the order given.

        An object this or another Accelerator prepared already comes back unchanged (no DDP
        inside DDP); it is recorded here once. Other objects pass through untouched.

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
        for obj in args:
            kind = kind_of(obj)
            if kind is not None and is_prepared(obj):
                self.prepared.add(kind, obj)
        if self.deepspeed_plugin is not None:
            result = self._prepare_deepspeed(self.deepspeed_plugin, args)
            return result[0] if len(result) == 1 else tuple(result)
        result = list(args)
        optimizers = [o for o in args if isinstance(o, torch.optim.Optimizer) and not is_prepared(o)]
        for kind in ("model", "optimizer", "dataloader", "scheduler"):  # schedulers need their optimizers first
            for i, obj in enumerate(args):
                if kind_of(obj) == kind and not is_prepared(obj):
                    result[i] = self._prepare_one(obj, device_placement[i], optimizers)
        return result[0] if len(result) == 1 else tuple(result)

    def _prepare_deepspeed(self, plugin: DeepSpeedPlugin, args: tuple[Any, ...]) -> list[Any]:
        from nbaccel.training.deepspeed_engine import prepare_deepspeed

        made = prepare_deepspeed(args, self.prepared, base_config=plugin.deepspeed_config,
                                 process=self.state, gradient_state=self.gradient_state,
                                 mixed_precision=self.mixed_precision, split_batches=self.split_batches,
                                 prepare_data_loader=self.prepare_data_loader)
        if made.engine is not None:
            self.deepspeed_engine, self.deepspeed_config = made.engine, made.config
        return made.objects

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
        if is_prepared(model):
            return self.prepared.add("model", model)
        if self.deepspeed_plugin is not None:
            return self._prepare_deepspeed(self.deepspeed_plugin, (model,))[0]
        place = self.device_placement if device_placement is None else device_placement
        fsdp_plugin = None if evaluation_mode else self.fsdp_plugin
        sharded = fsdp_plugin is not None
        # FSDP2 places each shard itself (shard_model); placing first would put the whole model on every GPU.
        if place and not sharded:
            before = list(model.parameters()) if self.device.type == "xla" else []
            model = model.to(self.device)
            if before:  # XLA: .to() makes new Parameter objects; the optimizers must follow them
                _switch_parameters(before, list(model.parameters()),
                                   list(_optimizers or []) + [o.optimizer for o in self.prepared.optimizers])
        if self.mixed_precision == "fp8" and not evaluation_mode:
            from nbaccel.training.fp8 import convert_model_to_fp8

            convert_model_to_fp8(model)
        if self.mixed_precision != "no":
            wrap_forward(model, self.mixed_precision, self.device, self.autocast_handler)
        trainable = any(p.requires_grad for p in model.parameters())
        if fsdp_plugin is not None:
            from nbaccel.training.fsdp import shard_model

            optimizers = list(_optimizers or []) + [o.optimizer for o in self.prepared.optimizers]
            model = shard_model(model, fsdp_plugin, self.device, self.num_processes, optimizers,
                                upcast=self.mixed_precision != "no")
        elif self.num_processes > 1 and trainable and not evaluation_mode and self.device.type == "xla":
            _broadcast_xla_weights(model)
        elif self.num_processes > 1 and trainable and not evaluation_mode:
            kwargs = self.ddp_handler.to_kwargs()
            if self.device.type == "cuda":
                kwargs.update(device_ids=[self.device.index], output_device=self.device.index)
            model = torch.nn.parallel.DistributedDataParallel(model, **kwargs)
            self.ddp_handler.register_comm_hook(model)
        return self.prepared.add("model", model)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
                          ) -> torch.optim.Optimizer:
        """Wrap ``optimizer`` so it steps only when gradients are synchronized (through the scaler for fp16).

        Returns an :class:`AcceleratedOptimizer`, or ``optimizer`` itself when it was prepared already.
        """
        if is_prepared(optimizer):
            return self.prepared.add("optimizer", optimizer)
        place = self.device_placement if device_placement is None else device_placement
        wrapped = AcceleratedOptimizer(optimizer, device_placement=place, scaler=self.scaler,
                                       gradient_state=self.gradient_state, device=self.device)
        return self.prepared.add("optimizer", wrapped)

    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        """Wrap ``scheduler`` so it steps with its optimizer, Accelerate's way."""
        if is_prepared(scheduler):
            return self.prepared.add("scheduler", scheduler)
        optimizer = next((o for o in self.prepared.optimizers if o.optimizer is scheduler.optimizer),
                         scheduler.optimizer)
        wrapped = AcceleratedScheduler(scheduler, optimizer, step_with_optimizer=self.step_scheduler_with_optimizer,
                                       split_batches=self.split_batches, num_processes=self.num_processes,
                                       gradient_state=self.gradient_state)
        return self.prepared.add("scheduler", wrapped)

    def prepare_data_loader(self, data_loader: DataLoader, device_placement: bool | None = None) -> Any:
        """Shard ``data_loader`` across processes and move its batches to the device."""
        if is_prepared(data_loader):
            return self.prepared.add("dataloader", data_loader)
        place = self.device_placement if device_placement is None else device_placement
        loader: Any = prepare_data_loader(data_loader, self.device if place else None, self.num_processes,
                                          self.process_index, self.dataloader_config, self.gradient_state)
        if place and self.device.type == "xla":
            loader = XlaDeviceLoader(loader, self.device)
        return self.prepared.add("dataloader", loader)

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """A prepared loader that starts after its first ``num_batches`` batches (to resume mid-epoch).

        Example:
            >>> accelerator.load_state("ckpt")                                # doctest: +SKIP
            >>> loader = accelerator.skip_first_batches(train_loader, 30)     # doctest: +SKIP
        """
        inner = dataloader._loader if isinstance(dataloader, XlaDeviceLoader) else dataloader
        skipped = skip_first_batches(inner, num_batches)
        return XlaDeviceLoader(skipped, self.device) if isinstance(dataloader, XlaDeviceLoader) else skipped


def _switch_parameters(old: list[torch.nn.Parameter], new: list[torch.nn.Parameter],
                       optimizers: list[torch.optim.Optimizer]) -> None:
    """Point ``optimizers`` (param groups and state) at ``new`` where they held ``old`` (same order)."""
    moved = {id(o): n for o, n in zip(old, new) if o is not n}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [moved.get(id(p), p) for p in group["params"]]
        for param in [p for p in optimizer.state if id(p) in moved]:
            optimizer.state[moved[id(param)]] = optimizer.state.pop(param)


def _broadcast_xla_weights(model: torch.nn.Module) -> None:
    """Give every XLA replica replica 0's parameters and buffers, as DDP does at construction.

    Replicas that run as threads of one process (TPU v2/v3) share torch's CPU generator, so
    ``manual_seed`` in each does not give them the same initial weights; no wrapper syncs them.
    """
    import torch_xla.core.xla_model as xm

    from nbaccel.training.optimizer import xla_sync

    xm.broadcast_master_param(model)
    xla_sync()
