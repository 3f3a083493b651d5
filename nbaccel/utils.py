"""Accelerate's ``accelerate.utils`` import path: re-exports only, so ``from accelerate.utils import X`` ports as is.

Nothing is defined here (nbaccel keeps no grab-bag of helpers): each name lives in the module whose
one job it belongs to, and this module exists only so that Accelerate's import lines keep working.
Names Accelerate has here that nbaccel does not (other hardware, integrations that are not installed,
names not ported yet) are listed in the README's "Coming from Accelerate" section.
"""

from __future__ import annotations

from nbaccel.availability import (
    compare_versions,
    is_bf16_available,
    is_cuda_available,
    is_datasets_available,
    is_deepspeed_available,
    is_fp16_available,
    is_import_timer_available,
    is_lomo_available,
    is_matplotlib_available,
    is_mlflow_available,
    is_mps_available,
    is_pandas_available,
    is_peft_available,
    is_peft_model,
    is_pynvml_available,
    is_pytest_available,
    is_rich_available,
    is_schedulefree_available,
    is_tensorboard_available,
    is_timm_available,
    is_torch_version,
    is_torch_xla_available,
    is_torchdata_available,
    is_torchdata_stateful_dataloader_available,
    is_torchvision_available,
    is_trackio_available,
    is_transformers_available,
    is_triton_available,
    is_wandb_available,
)
from nbaccel.big_modeling.device_map import (
    check_device_map,
    infer_auto_device_map,
)
from nbaccel.big_modeling.layerwise_casting import (
    SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING,
)
from nbaccel.big_modeling.loading import (
    load_checkpoint_in_model,
)
from nbaccel.big_modeling.module_state import (
    align_module_device,
    calculate_maximum_sizes,
    check_tied_parameters_on_same_device,
    clean_device_map,
    clean_state_dict_for_safetensors,
    compute_module_total_buffer_size,
    extract_submodules_state_dict,
    get_module_children_bottom_up,
    get_module_size_with_ties,
    get_non_persistent_buffers,
    get_state_dict_offloaded_model,
    has_offloaded_params,
    id_tensor_storage,
    load_offloaded_weights,
    retie_parameters,
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
    CustomDtype,
    compute_module_sizes,
    dtype_byte_size,
    find_tied_parameters,
    get_balanced_memory,
    get_max_layer_size,
    get_max_memory,
)
from nbaccel.big_modeling.state_dict_file import (
    load_state_dict,
)
from nbaccel.big_modeling.tensors import (
    find_device,
    named_module_tensors,
    set_module_tensor_to_device,
)
from nbaccel.device_backend import (
    get_accelerator_free_memory,
    get_current_device_type,
    get_distributed_backend,
    get_torch_accelerator_backend,
    normalize_device,
)
from nbaccel.distributed_type import (
    DistributedType,
)
from nbaccel.env_flags import (
    get_int_from_env,
    parse_choice_from_env,
    parse_flag_from_env,
    str_to_bool,
)
from nbaccel.environment import (
    clear_environment,
    patch_environment,
)
from nbaccel.errors import (
    DistributedOperationException,
)
from nbaccel.file_size import (
    convert_bytes,
    convert_file_size_to_int,
)
from nbaccel.hardware import (
    check_os_kernel,
)
from nbaccel.introspection import (
    are_libraries_initialized,
    check_tied_parameters_in_config,
    get_model_tp_size,
    get_pretty_name,
    model_has_dtensor,
)
from nbaccel.launch.rendezvous import (
    is_port_in_use,
)
from nbaccel.nested_data import (
    TensorInformation,
    concatenate,
    convert_to_fp32,
    find_batch_size,
    get_data_structure,
    honor_type,
    ignorant_find_batch_size,
    initialize_tensors,
    is_namedtuple,
    is_tensor_information,
    is_torch_tensor,
    listify,
    merge_dicts,
    pad_input_tensors,
    recursive_getattr,
    recursively_apply,
    send_to_device,
    slice_tensors,
)
from nbaccel.ops import (
    CannotPadNestedTensorWarning,
    broadcast,
    broadcast_object_list,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
)
from nbaccel.process_state import (
    wait_for_everyone,
)
from nbaccel.progress_bars import tqdm
from nbaccel.safe_load import (
    load,
)
from nbaccel.tensor_copy import (
    copy_tensor_to_devices,
)
from nbaccel.tracking.base import LoggerType
from nbaccel.training.ddp_comm_hooks import (
    DDPCommunicationHookType,
)
from nbaccel.training.kwargs_handlers import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
)
from nbaccel.training.memory import (
    find_executable_batch_size,
    release_memory,
)
from nbaccel.training.plugins import (
    DataLoaderConfiguration,
    DeepSpeedPlugin,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    ProjectConfiguration,
)
from nbaccel.training.precision import (
    PrecisionType,
    convert_outputs_to_fp32,
    get_grad_scaler,
    get_mixed_precision_context_manager,
)
from nbaccel.training.random import (
    RNGType,
    set_seed,
    synchronize_rng_state,
    synchronize_rng_states,
)
from nbaccel.training.saving import (
    save,
)
from nbaccel.training.unwrap import (
    extract_model_from_parallel,
    has_compiled_regions,
    is_compiled_module,
)

__all__ = [
    "AutocastKwargs",
    "CannotPadNestedTensorWarning",
    "CustomDtype",
    "DDPCommunicationHookType",
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
    "LoggerType",
    "OffloadedWeightsLoader",
    "PrecisionType",
    "PrefixedDataset",
    "ProjectConfiguration",
    "RNGType",
    "SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING",
    "TensorInformation",
    "align_module_device",
    "are_libraries_initialized",
    "broadcast",
    "broadcast_object_list",
    "calculate_maximum_sizes",
    "check_device_map",
    "check_os_kernel",
    "check_tied_parameters_in_config",
    "check_tied_parameters_on_same_device",
    "clean_device_map",
    "clean_state_dict_for_safetensors",
    "clear_environment",
    "compare_versions",
    "compute_module_sizes",
    "compute_module_total_buffer_size",
    "concatenate",
    "convert_bytes",
    "convert_file_size_to_int",
    "convert_outputs_to_fp32",
    "convert_to_fp32",
    "copy_tensor_to_devices",
    "dtype_byte_size",
    "extract_model_from_parallel",
    "extract_submodules_state_dict",
    "find_batch_size",
    "find_device",
    "find_executable_batch_size",
    "find_tied_parameters",
    "gather",
    "gather_object",
    "get_accelerator_free_memory",
    "get_balanced_memory",
    "get_current_device_type",
    "get_data_structure",
    "get_distributed_backend",
    "get_grad_scaler",
    "get_int_from_env",
    "get_max_layer_size",
    "get_max_memory",
    "get_mixed_precision_context_manager",
    "get_model_tp_size",
    "get_module_children_bottom_up",
    "get_module_size_with_ties",
    "get_non_persistent_buffers",
    "get_pretty_name",
    "get_state_dict_offloaded_model",
    "get_torch_accelerator_backend",
    "has_compiled_regions",
    "has_offloaded_params",
    "honor_type",
    "id_tensor_storage",
    "ignorant_find_batch_size",
    "infer_auto_device_map",
    "initialize_tensors",
    "is_bf16_available",
    "is_compiled_module",
    "is_cuda_available",
    "is_datasets_available",
    "is_deepspeed_available",
    "is_fp16_available",
    "is_import_timer_available",
    "is_lomo_available",
    "is_matplotlib_available",
    "is_mlflow_available",
    "is_mps_available",
    "is_namedtuple",
    "is_pandas_available",
    "is_peft_available",
    "is_peft_model",
    "is_port_in_use",
    "is_pynvml_available",
    "is_pytest_available",
    "is_rich_available",
    "is_schedulefree_available",
    "is_tensor_information",
    "is_tensorboard_available",
    "is_timm_available",
    "is_torch_tensor",
    "is_torch_version",
    "is_torch_xla_available",
    "is_torchdata_available",
    "is_torchdata_stateful_dataloader_available",
    "is_torchvision_available",
    "is_trackio_available",
    "is_transformers_available",
    "is_triton_available",
    "is_wandb_available",
    "listify",
    "load",
    "load_checkpoint_in_model",
    "load_offloaded_weight",
    "load_offloaded_weights",
    "load_state_dict",
    "merge_dicts",
    "model_has_dtensor",
    "named_module_tensors",
    "normalize_device",
    "offload_state_dict",
    "offload_weight",
    "pad_across_processes",
    "pad_input_tensors",
    "parse_choice_from_env",
    "parse_flag_from_env",
    "patch_environment",
    "recursive_getattr",
    "recursively_apply",
    "reduce",
    "release_memory",
    "retie_parameters",
    "save",
    "save_offload_index",
    "send_to_device",
    "set_module_tensor_to_device",
    "set_seed",
    "slice_tensors",
    "str_to_bool",
    "synchronize_rng_state",
    "synchronize_rng_states",
    "tqdm",
    "wait_for_everyone",
]
