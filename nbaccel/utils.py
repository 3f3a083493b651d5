"""Accelerate's ``accelerate.utils`` import path: re-exports only, so ``from accelerate.utils import X`` ports as is.

Nothing is defined here (nbaccel keeps no grab-bag of helpers): each name lives in the module whose
one job it belongs to, and this module exists only so that Accelerate's import lines keep working.
Names Accelerate has here that nbaccel does not (other hardware, integrations that are not installed,
names not ported yet) are listed in the README's "Coming from Accelerate" section.
"""

from __future__ import annotations

from nbaccel.big_modeling.device_map import (
    check_device_map,
    infer_auto_device_map,
)
from nbaccel.big_modeling.loading import (
    load_checkpoint_in_model,
)
from nbaccel.big_modeling.offload import (
    OffloadedWeightsLoader,
    PrefixedDataset,
    load_offloaded_weight,
    offload_state_dict,
    offload_weight,
    save_offload_index,
)
from nbaccel.big_modeling.sizes import (
    compute_module_sizes,
    dtype_byte_size,
    find_tied_parameters,
    get_balanced_memory,
    get_max_layer_size,
    get_max_memory,
)
from nbaccel.big_modeling.tensors import (
    find_device,
    named_module_tensors,
    set_module_tensor_to_device,
)
from nbaccel.distributed_type import (
    DistributedType,
)
from nbaccel.errors import (
    DistributedOperationException,
)
from nbaccel.file_size import (
    convert_file_size_to_int,
)
from nbaccel.ops import (
    broadcast,
    broadcast_object_list,
    concatenate,
    find_batch_size,
    gather,
    gather_object,
    pad_across_processes,
    recursively_apply,
    reduce,
    send_to_device,
    slice_tensors,
)
from nbaccel.training.memory import (
    find_executable_batch_size,
)
from nbaccel.training.plugins import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    FullyShardedDataParallelPlugin,
    GradScalerKwargs,
    GradientAccumulationPlugin,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProjectConfiguration,
)
from nbaccel.training.precision import (
    convert_outputs_to_fp32,
)
from nbaccel.training.random import (
    set_seed,
    synchronize_rng_states,
)

__all__ = [
    "AutocastKwargs",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "DistributedDataParallelKwargs",
    "DistributedOperationException",
    "DistributedType",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "OffloadedWeightsLoader",
    "PrefixedDataset",
    "ProjectConfiguration",
    "broadcast",
    "broadcast_object_list",
    "check_device_map",
    "compute_module_sizes",
    "concatenate",
    "convert_file_size_to_int",
    "convert_outputs_to_fp32",
    "dtype_byte_size",
    "find_batch_size",
    "find_device",
    "find_executable_batch_size",
    "find_tied_parameters",
    "gather",
    "gather_object",
    "get_balanced_memory",
    "get_max_layer_size",
    "get_max_memory",
    "infer_auto_device_map",
    "load_checkpoint_in_model",
    "load_offloaded_weight",
    "named_module_tensors",
    "offload_state_dict",
    "offload_weight",
    "pad_across_processes",
    "recursively_apply",
    "reduce",
    "save_offload_index",
    "send_to_device",
    "set_module_tensor_to_device",
    "set_seed",
    "slice_tensors",
    "synchronize_rng_states",
]
