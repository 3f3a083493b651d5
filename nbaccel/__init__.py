"""nbaccel: distributed PyTorch from a notebook, with Hugging Face Accelerate's API.

Names are loaded on first use, so ``import nbaccel`` stays fast and imports neither IPython
nor ipywidgets. ``load_ipython_extension`` makes ``%load_ext nbaccel`` work.
"""

from __future__ import annotations

import importlib
from typing import Any

from nbaccel.version import __version__  # noqa: F401 - re-exported (in __all__)

# name -> module that defines it. Each section belongs to one part of the package.
_EXPORTS: dict[str, str] = {
    # config, environment, errors
    "ConfigError": "nbaccel.errors",
    "EnvironmentStateError": "nbaccel.errors",
    "LaunchConfig": "nbaccel.config",
    "LaunchError": "nbaccel.errors",
    "LaunchTimeoutError": "nbaccel.errors",
    "NbaccelError": "nbaccel.errors",
    "PayloadPicklingError": "nbaccel.errors",
    "ProcessExitedError": "nbaccel.errors",
    "WorkerFailedError": "nbaccel.errors",
    "is_rich_available": "nbaccel.availability",
    "load_config": "nbaccel.config",
    "save_config": "nbaccel.config",
    # launching
    "WorkerFailure": "nbaccel.launch.failures",
    "WorkerPool": "nbaccel.launch.pool",
    "WorkerPoolError": "nbaccel.errors",
    "debug_launcher": "nbaccel.launch.launcher",
    "notebook_launcher": "nbaccel.launch.launcher",
    "worker_namespace": "nbaccel.launch.pool_worker",
    # experiment tracking
    "GeneralTracker": "nbaccel.tracking.base",
    "LoggerType": "nbaccel.tracking.base",
    "last_run_history": "nbaccel.tracking.history",
    # process state
    "AcceleratorState": "nbaccel.partial_state",
    "DistributedType": "nbaccel.distributed_type",
    "PartialState": "nbaccel.partial_state",
    "ProcessState": "nbaccel.state",
    # training (Accelerator)
    "AcceleratedOptimizer": "nbaccel.training.optimizer",
    "AcceleratedScheduler": "nbaccel.training.scheduler",
    "Accelerator": "nbaccel.training.accelerator",
    "AutocastKwargs": "nbaccel.training.kwargs_handlers",
    "BatchSamplerShard": "nbaccel.training.data_sharding",
    "DataLoaderConfiguration": "nbaccel.training.plugins",
    "DataLoaderDispatcher": "nbaccel.training.data_loader",
    "DataLoaderShard": "nbaccel.training.data_loader",
    "DeepSpeedPlugin": "nbaccel.training.plugins",
    "DistributedDataParallelKwargs": "nbaccel.training.kwargs_handlers",
    "DDPCommunicationHookType": "nbaccel.training.ddp_comm_hooks",
    "DistributedOperationError": "nbaccel.errors",
    "FullyShardedDataParallelPlugin": "nbaccel.training.plugins",
    "GradScalerKwargs": "nbaccel.training.kwargs_handlers",
    "GradientAccumulationPlugin": "nbaccel.training.plugins",
    "GradientState": "nbaccel.training.gradient_state",
    "InitProcessGroupKwargs": "nbaccel.training.kwargs_handlers",
    "IterableDatasetShard": "nbaccel.training.data_sharding",
    "MissingDependencyError": "nbaccel.errors",
    "ProjectConfiguration": "nbaccel.training.plugins",
    "SeedableRandomSampler": "nbaccel.training.data_sharding",
    "SkipBatchSampler": "nbaccel.training.data_sharding",
    "broadcast": "nbaccel.ops",
    "broadcast_object_list": "nbaccel.ops",
    "concatenate": "nbaccel.nested_data",
    "find_batch_size": "nbaccel.nested_data",
    "find_executable_batch_size": "nbaccel.training.memory",
    "gather": "nbaccel.ops",
    "gather_object": "nbaccel.ops",
    "pad_across_processes": "nbaccel.ops",
    "prepare_data_loader": "nbaccel.training.loader_preparation",
    "recursively_apply": "nbaccel.nested_data",
    "reduce": "nbaccel.ops",
    "send_to_device": "nbaccel.nested_data",
    "set_seed": "nbaccel.training.random",
    "skip_first_batches": "nbaccel.training.loader_preparation",
    "slice_tensors": "nbaccel.nested_data",
    "synchronize_rng_states": "nbaccel.training.random",
    # big-model inference
    "AlignDevicesHook": "nbaccel.big_modeling.hooks",
    "CheckpointDiskFullError": "nbaccel.errors",
    "CheckpointError": "nbaccel.errors",
    "CheckpointMismatchError": "nbaccel.errors",
    "CpuOffload": "nbaccel.big_modeling.hooks",
    "DeviceMapError": "nbaccel.errors",
    "ModelHook": "nbaccel.big_modeling.hooks",
    "OffloadedWeightsLoader": "nbaccel.big_modeling.offload",
    "SequentialHook": "nbaccel.big_modeling.hooks",
    "UnsafeCheckpointError": "nbaccel.errors",
    "UserCpuOffloadHook": "nbaccel.big_modeling.hooks",
    "add_hook_to_module": "nbaccel.big_modeling.hooks",
    "compute_module_sizes": "nbaccel.big_modeling.sizes",
    "cpu_offload": "nbaccel.big_modeling.dispatch",
    "cpu_offload_with_hook": "nbaccel.big_modeling.dispatch",
    "disk_offload": "nbaccel.big_modeling.dispatch",
    "dispatch_model": "nbaccel.big_modeling.dispatch",
    "find_tied_parameters": "nbaccel.big_modeling.sizes",
    "get_balanced_memory": "nbaccel.big_modeling.sizes",
    "get_max_memory": "nbaccel.big_modeling.sizes",
    "infer_auto_device_map": "nbaccel.big_modeling.device_map",
    "init_empty_weights": "nbaccel.big_modeling.init",
    "init_on_device": "nbaccel.big_modeling.init",
    "load_checkpoint_and_dispatch": "nbaccel.big_modeling.loading",
    "load_checkpoint_in_model": "nbaccel.big_modeling.loading",
    "remove_hook_from_module": "nbaccel.big_modeling.hooks",
    "set_module_tensor_to_device": "nbaccel.big_modeling.tensors",
}

__all__ = sorted([*_EXPORTS, "__version__", "load_ipython_extension", "unload_ipython_extension"])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nbaccel' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext nbaccel``: register nbaccel's magics."""
    from nbaccel.magics import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext nbaccel``: remove nbaccel's magics."""
    from nbaccel.magics import unload_ipython_extension as unload

    unload(ipython)
