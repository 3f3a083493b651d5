"""What an Accelerator prepared: one registry of its objects, and the mark that makes ``prepare`` idempotent.

An :class:`~nbaccel.Accelerator` owns one :class:`PreparedObjects`. ``prepare`` records every
model, optimizer, scheduler and dataloader it returns there, in order, and marks each object
(Accelerate's ``_is_accelerate_prepared`` attribute), so handing a prepared object to
``prepare`` again returns it unchanged instead of wrapping it twice (DDP inside DDP). Saving
and loading (:mod:`nbaccel.training.training_state`) and the DeepSpeed path
(:mod:`nbaccel.training.deepspeed_engine`) are given the registry explicitly; nothing else reaches into
the Accelerator for it. Accelerate's private lists (``accelerator._models``, ...), which user
code and libraries read, are views of the registry's lists.

What always holds: an object appears at most once in each list; every object in a list is
marked, with the id of the process that prepared it.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import torch
from torch.utils.data import DataLoader

from nbaccel.training.data_loader import DataLoaderShard
from nbaccel.training.optimizer import AcceleratedOptimizer
from nbaccel.training.scheduler import AcceleratedScheduler
from nbaccel.training.xla_loader import XlaDeviceLoader

__all__ = ["LoadStatePreHook", "PreparedKind", "PreparedObjects", "RegistryView", "SaveStatePreHook", "is_prepared",
           "kind_of"]

SaveStatePreHook = Callable[[list[torch.nn.Module], list[dict[str, torch.Tensor]], str], None]
LoadStatePreHook = Callable[[list[torch.nn.Module], str], None]
PreparedKind = Literal["model", "optimizer", "scheduler", "dataloader"]
T = TypeVar("T")

# Accelerate's attribute name, so objects prepared by either library are recognized by both.
_MARK = "_is_accelerate_prepared"


def is_prepared(obj: Any) -> bool:
    """Whether ``obj`` was returned by an Accelerator's ``prepare`` (nbaccel's or Accelerate's).

    The wrappers ``prepare`` makes count too when built by hand (``prepare_data_loader(...)``).
    An object prepared in another process (the notebook, before a launch) does not.

    Example:
        >>> is_prepared(torch.nn.Linear(1, 1)), is_prepared(PreparedObjects().add("model", torch.nn.Linear(1, 1)))
        (False, True)
    """
    mark = getattr(obj, _MARK, False)
    # nbaccel marks with this process's id: a model prepared in the notebook and inherited by a
    # forked (or pickled to a spawned) worker is not prepared there, so the worker still wraps it in DDP.
    marked = mark is True or (type(mark) is int and mark == os.getpid())
    return marked or isinstance(obj, (AcceleratedOptimizer, AcceleratedScheduler, DataLoaderShard, XlaDeviceLoader))


def kind_of(obj: Any) -> PreparedKind | None:
    """Which list of the registry ``obj`` belongs in; ``None`` for what ``prepare`` leaves alone.

    Example:
        >>> kind_of(torch.nn.Linear(1, 1)), kind_of("text")
        ('model', None)
    """
    if isinstance(obj, torch.nn.Module):
        return "model"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, (DataLoader, XlaDeviceLoader)):
        return "dataloader"
    if isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, AcceleratedScheduler)):
        return "scheduler"
    return None


@dataclass(eq=False)
class PreparedObjects:
    """The objects one Accelerator prepared or registered, each list in the order it was given.

    Args:
        models: prepared models (wrappers included: DDP, FSDP2 modules, DeepSpeed engines).
        optimizers: prepared optimizers (``AcceleratedOptimizer``).
        schedulers: prepared schedulers (``AcceleratedScheduler``).
        dataloaders: prepared dataloaders.
        custom_objects: objects registered with ``register_for_checkpointing``.
        save_state_pre_hooks: ``register_save_state_pre_hook``'s hooks, by handle id.
        load_state_pre_hooks: ``register_load_state_pre_hook``'s hooks, by handle id.

    Example:
        >>> prepared = PreparedObjects()
        >>> model = prepared.add("model", torch.nn.Linear(1, 1))
        >>> is_prepared(model), prepared.add("model", model) is model, len(prepared.models)
        (True, True, 1)
    """

    models: list[torch.nn.Module] = field(default_factory=list)
    optimizers: list[Any] = field(default_factory=list)
    schedulers: list[Any] = field(default_factory=list)
    dataloaders: list[Any] = field(default_factory=list)
    custom_objects: list[Any] = field(default_factory=list)
    save_state_pre_hooks: OrderedDict[int, SaveStatePreHook] = field(default_factory=OrderedDict)
    load_state_pre_hooks: OrderedDict[int, LoadStatePreHook] = field(default_factory=OrderedDict)

    def list_of(self, kind: PreparedKind) -> list[Any]:
        """The list that holds objects of ``kind``."""
        return {"model": self.models, "optimizer": self.optimizers, "scheduler": self.schedulers,
                "dataloader": self.dataloaders}[kind]

    def add(self, kind: PreparedKind, obj: T) -> T:
        """Record ``obj`` as prepared (once, by identity) and mark it; returns ``obj``."""
        items = self.list_of(kind)
        if not any(item is obj for item in items):
            items.append(obj)
        setattr(obj, _MARK, os.getpid())  # truthy, as Accelerate's `True`; see is_prepared
        return obj

    def optimizer_for(self, model_index: int) -> Any:
        """The prepared optimizer at the same position as model ``model_index`` (``None`` if none)."""
        return self.optimizers[model_index] if model_index < len(self.optimizers) else None

    def clear(self) -> None:
        """Forget the prepared models, optimizers, schedulers and dataloaders (Accelerate's ``free_memory``).

        Objects registered for checkpointing and hooks stay, as in Accelerate.
        """
        for items in (self.models, self.optimizers, self.schedulers, self.dataloaders):
            items.clear()



class RegistryView:
    """An Accelerator attribute that is one of its registry's collections (Accelerate's ``_models``, ...).

    Reading gives the registry's own list (or dict), so appending to it registers; assigning
    replaces the registry's contents, as ``accelerator._models = []`` does in Accelerate.

    Args:
        name: the :class:`PreparedObjects` field.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, owner: Any, owner_type: type | None = None) -> Any:
        if owner is None:
            return self
        return getattr(owner.prepared, self.name)

    def __set__(self, owner: Any, value: Any) -> None:
        target = getattr(owner.prepared, self.name)
        items = list(value.items()) if isinstance(target, dict) else list(value)
        target.clear()
        if isinstance(target, dict):
            target.update(items)
        else:
            target.extend(items)
