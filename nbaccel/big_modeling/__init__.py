"""Big-model inference: build models empty, map them over devices, load, offload, dispatch.

The same API as Accelerate's big-modeling utilities; see the modules for each part:
:mod:`~nbaccel.big_modeling.init` (empty models), :mod:`~nbaccel.big_modeling.sizes` and
:mod:`~nbaccel.big_modeling.device_map` (budgets and maps),
:mod:`~nbaccel.big_modeling.checkpoint_files` (reading checkpoints),
:mod:`~nbaccel.big_modeling.loading`, :mod:`~nbaccel.big_modeling.offload`,
:mod:`~nbaccel.big_modeling.hooks` and :mod:`~nbaccel.big_modeling.dispatch`;
:func:`~nbaccel.big_modeling.offload_report.offload_report` says how close to the bus an
offloaded forward ran.
"""

from __future__ import annotations

from nbaccel.big_modeling.checkpoint_layout import open_checkpoint
from nbaccel.big_modeling.device_map import infer_auto_device_map
from nbaccel.big_modeling.dispatch import (
                                           cpu_offload,
                                           cpu_offload_with_hook,
                                           disk_offload,
                                           dispatch_model,
)
from nbaccel.big_modeling.cpu_offload_hook import CpuOffload, UserCpuOffloadHook
from nbaccel.big_modeling.hooks import (
                                           AlignDevicesHook,
                                           ModelHook,
                                           SequentialHook,
                                           add_hook_to_module,
                                           remove_hook_from_module,
)
from nbaccel.big_modeling.init import init_empty_weights, init_on_device
from nbaccel.big_modeling.layerwise_casting import (
                                           SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING,
                                           attach_layerwise_casting_hooks,
)
from nbaccel.big_modeling.loading import (
                                           load_checkpoint_and_dispatch,
                                           load_checkpoint_in_model,
)
from nbaccel.big_modeling.offload import OffloadedWeightsLoader, PrefixedDataset
from nbaccel.big_modeling.offload_report import OffloadReport, offload_report
from nbaccel.big_modeling.sizes import (
                                           compute_module_sizes,
                                           find_tied_parameters,
                                           get_balanced_memory,
                                           get_max_memory,
)
from nbaccel.big_modeling.tensors import set_module_tensor_to_device

__all__ = [
    "AlignDevicesHook",
    "CpuOffload",
    "ModelHook",
    "OffloadReport",
    "OffloadedWeightsLoader",
    "PrefixedDataset",
    "SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING",
    "SequentialHook",
    "UserCpuOffloadHook",
    "add_hook_to_module",
    "attach_layerwise_casting_hooks",
    "compute_module_sizes",
    "cpu_offload",
    "cpu_offload_with_hook",
    "disk_offload",
    "dispatch_model",
    "find_tied_parameters",
    "get_balanced_memory",
    "get_max_memory",
    "infer_auto_device_map",
    "init_empty_weights",
    "init_on_device",
    "load_checkpoint_and_dispatch",
    "load_checkpoint_in_model",
    "offload_report",
    "open_checkpoint",
    "remove_hook_from_module",
    "set_module_tensor_to_device",
]
