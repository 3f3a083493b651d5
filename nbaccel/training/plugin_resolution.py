"""The Accelerator's constructor arguments turned into the plugins it runs with.

Accelerate lets several arguments say the same thing (``split_batches=`` or a
``DataLoaderConfiguration``; ``gradient_accumulation_steps=`` or a plugin; DeepSpeed from a plugin
or from the launch's settings). Each function here picks the one source, refuses two, and checks
that what was chosen can run here.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from nbaccel.errors import ConfigError, MissingDependencyError
from nbaccel.training.kwargs_handlers import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
)
from nbaccel.training.plugins import (
    DataLoaderConfiguration,
    DeepSpeedPlugin,
    GradientAccumulationPlugin,
)

__all__ = ["collect_handlers", "resolve_accumulation_plugin", "resolve_dataloader_config", "resolve_deepspeed_plugin"]

_HANDLERS = (DistributedDataParallelKwargs, GradScalerKwargs, AutocastKwargs, InitProcessGroupKwargs)


def collect_handlers(handlers: list[KwargsHandler] | None) -> dict[type, Any]:
    """``{handler class: handler}`` from ``kwargs_handlers``, one per kind.

    Raises:
        ConfigError: an item is not a known handler, or a kind appears twice.
    """
    found: dict[type, Any] = {}
    for handler in handlers or []:
        kind = next((k for k in _HANDLERS if isinstance(handler, k)), None)
        if kind is None:
            raise ConfigError(f"kwargs_handlers items must be one of {[k.__name__ for k in _HANDLERS]} (got "
                              f"{handler!r} of type {type(handler).__name__})", key="kwargs_handlers",
                              value=handler, valid=[k.__name__ for k in _HANDLERS])
        if kind in found:
            raise ConfigError(f"kwargs_handlers holds two {kind.__name__} objects; pass one", key="kwargs_handlers",
                              value=kind.__name__, valid="one handler per kind")
        found[kind] = handler
    return found


def resolve_dataloader_config(config: DataLoaderConfiguration | None, split_batches: bool | None,
                       even_batches: bool | None, dispatch_batches: bool | None) -> DataLoaderConfiguration:
    """The dataloader configuration from the object or the shorthand arguments (not both).

    Raises:
        ConfigError: both were given.
    """
    shorthands = {"split_batches": split_batches, "even_batches": even_batches, "dispatch_batches": dispatch_batches}
    given = {k: v for k, v in shorthands.items() if v is not None}
    if config is not None and given:
        raise ConfigError(f"pass {sorted(given)} inside `dataloader_config`, not next to it",
                          key=sorted(given)[0], value=given, valid="DataLoaderConfiguration(...) fields")
    return config or DataLoaderConfiguration(**given)


def resolve_accumulation_plugin(plugin: GradientAccumulationPlugin | None, steps: int) -> GradientAccumulationPlugin:
    """The accumulation plugin from the object or the steps count (not both).

    Raises:
        ConfigError: both were given.
    """
    if plugin is not None and steps != 1:
        raise ConfigError(f"pass either gradient_accumulation_steps={steps} or gradient_accumulation_plugin, not "
                          "both; put num_steps in the plugin", key="gradient_accumulation_steps", value=steps,
                          valid="1 when a plugin is given")
    return plugin or GradientAccumulationPlugin(num_steps=steps)


def resolve_deepspeed_plugin(plugin: DeepSpeedPlugin | None, settings: Any) -> DeepSpeedPlugin | None:
    """The DeepSpeed plugin (given, or from the launch's settings), checked to be usable here.

    Raises:
        MissingDependencyError: DeepSpeed settings were given but ``deepspeed`` is not installed.
    """
    if plugin is None and settings.distributed_type == "DEEPSPEED":
        plugin = DeepSpeedPlugin.from_config(settings.deepspeed_config)
    if plugin is not None and importlib.util.find_spec("deepspeed") is None:
        raise MissingDependencyError(
            "DeepSpeed settings were given (DeepSpeedPlugin or distributed_type 'DEEPSPEED') but the `deepspeed` "
            "package is not installed; install it with `pip install deepspeed`, or train without DeepSpeed "
            "(FSDP2 via FullyShardedDataParallelPlugin shards too)", package="deepspeed",
            needed_for="DeepSpeedPlugin", install="pip install deepspeed")
    return plugin
