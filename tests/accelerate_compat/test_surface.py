"""nbaccel's public names and signatures against Accelerate 1.16's, module by module.

Every public name Accelerate has at ``accelerate``, ``accelerate.utils``, ``accelerate.hooks``,
``accelerate.data_loader``, ``accelerate.state`` and ``accelerate.big_modeling`` exists at the
same ``nbaccel`` path, or is listed in :data:`NOT_HERE` with the reason (and in the README's
"Coming from Accelerate" section). Every parameter name an Accelerate callable takes, nbaccel's
takes too, or the name is listed in :data:`SIGNATURE_DIFFERS`. Both lists are checked to be exact,
so a name added later must be taken off them. Skipped where Accelerate is not installed.
"""

from __future__ import annotations

import importlib
import inspect
import re
import types
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

# accelerate and accelerate.utils gather names from submodules; the others define their own.
MODULES = {"accelerate": True, "accelerate.utils": True, "accelerate.hooks": False, "accelerate.data_loader": False,
           "accelerate.state": False, "accelerate.big_modeling": False}

_HARDWARE = ("needs hardware nbaccel has no engine for (Ascend NPU, Cambricon MLU, SDAA, MUSA, Intel XPU, Gaudi HPU, "
             "Neuron, ROCm SMI)")
_MEGATRON = "Megatron-LM integration (not installed; nbaccel has no Megatron engine)"
_QUANT = "quantization / FP8 integrations (bitsandbytes, torchao, Transformer Engine) that nbaccel does not wrap"
_PARALLEL = "tensor / context / N-D parallelism (ParallelismConfig, torch_tp_plugin): not supported by nbaccel"
_DEEPSPEED = ("DeepSpeed internals (ZeRO-3 gathering, sequence parallelism, launcher env): DeepSpeed is used only "
              "through the Accelerator")
_FSDP = ("FSDP1-era and FSDP2 internals: nbaccel shards with FSDP2 inside Accelerator.prepare; the helpers are not "
         "exposed")
_LAUNCH = "Accelerate's CLI / SageMaker / TPU-pod launch internals: nbaccel launches with its own launcher and config"
_STATEFUL = ("torchdata's StatefulDataLoader integration (the adapter wraps either loader): nbaccel's loaders subclass "
             "torch's DataLoader directly")
_TRACKERS = "trackers nbaccel does not integrate (it has TensorBoard, MLflow, W&B and trackio)"
_COMPILE = ("the Accelerator's torch.compile and profiler integration (dynamo_backend, regional compilation, "
            "profile()): nbaccel's Accelerator has none; compile the model before prepare")

NOT_HERE: dict[str, str] = {
    **dict.fromkeys("is_hpu_available is_habana_gaudi1 is_mlu_available is_musa_available is_neuron_available "
                    "is_npu_available is_sdaa_available is_xpu_available is_xccl_available is_amdsmi_available "
                    "is_rocm_available".split(), _HARDWARE),
    **dict.fromkeys("AbstractTrainStep BertTrainStep GPTTrainStep T5TrainStep MegatronLMDummyDataLoader "
                    "MegatronLMDummyScheduler MegatronLMPlugin add_model_config_to_megatron_parser "
                    "avg_losses_across_data_parallel_group is_megatron_lm_available".split(), _MEGATRON),
    **dict.fromkeys("AORecipeKwargs TERecipeKwargs BnbQuantizationConfig apply_fp8_autowrap contextual_fp8_autocast "
                    "convert_model convert_model_to_fp8_ao filter_first_and_last_linear_layers has_4bit_bnb_layers "
                    "has_ao_layers has_transformer_engine_layers load_and_quantize_model is_4bit_bnb_available "
                    "is_8bit_bnb_available is_bnb_available is_bitsandbytes_multi_backend_available "
                    "is_torchao_available torchao_required is_transformer_engine_available "
                    "is_transformer_engine_mxfp8_available check_cuda_fp8_capability is_fp8_available".split(), _QUANT),
    **dict.fromkeys("ParallelismConfig TorchContextParallelConfig TorchTensorParallelConfig "
                    "TorchTensorParallelPlugin".split(), _PARALLEL),
    **dict.fromkeys("DeepSpeedSequenceParallelConfig GatheredParameters compile_regions_deepspeed deepspeed_required "
                    "prepare_deepspeed_cmd_env".split(), _DEEPSPEED),
    **dict.fromkeys("fsdp2_apply_ac fsdp2_canonicalize_names fsdp2_load_full_state_dict fsdp2_prepare_model "
                    "fsdp2_switch_optimizer_parameters get_fsdp2_grad_scaler load_fsdp_model load_fsdp_optimizer "
                    "save_fsdp_model save_fsdp_optimizer merge_fsdp_weights disable_fsdp_ram_efficient_loading "
                    "enable_fsdp_ram_efficient_loading compile_regions_fsdp2 ensure_weights_retied".split(), _FSDP),
    **dict.fromkeys("SageMakerDistributedType ComputeEnvironment prepare_sagemager_args_inputs is_sagemaker_available "
                    "is_boto3_available install_xla prepare_tpu PrepareForLaunch prepare_multi_gpu_env "
                    "prepare_simple_launcher_cmd_env write_basic_config convert_dict_to_env_variables "
                    "purge_accelerate_environment get_cpu_distributed_information set_numa_affinity "
                    "check_cuda_p2p_ib_support get_gpu_info".split(), _LAUNCH),
    **dict.fromkeys("is_aim_available is_clearml_available is_comet_ml_available is_dvclive_available "
                    "is_swanlab_available".split(), _TRACKERS),
    **dict.fromkeys("ProfileKwargs DynamoBackend TorchDynamoPlugin compile_regions".split(), _COMPILE),
    "DataLoaderAdapter": _STATEFUL,
}
"""Accelerate names nbaccel does not have, with the reason; the README lists the same."""

SIGNATURE_DIFFERS: dict[str, str] = {
    "Accelerator": ("no deepspeed_plugins / dynamo / megatron_lm / parallelism_config / torch_tp_plugin "
                    "(see the names above)"),
    "AcceleratorState": "one state per process; training settings (mixed_precision, plugins) live on the Accelerator",
    "DeepSpeedPlugin": ("no NVMe offload paths, MoE classes, zero3_init_flag, zero3_save_16bit_model "
                        "(set them in the config)"),
    "InitProcessGroupKwargs": "no init_method: workers always join through env://",
    "set_module_tensor_to_device": "no fp16_statistics (bitsandbytes), tied_params_map, clear_cache, non_blocking",
    "slice_tensors": "no num_processes / process_index (XLA-only in Accelerate)",
    **dict.fromkeys("AlignDevicesHook attach_align_device_hook attach_execution_device_hook "
                    "attach_align_device_hook_on_blocks".split(),
                    "no tied_params_map: loading makes tied names share one tensor (no per-device copies to track)"),
    "SeedableRandomSampler": "names RandomSampler's parameters (Accelerate passes them through *args, **kwargs)",
}
"""Callables whose parameters differ from Accelerate's, with the reason."""


def public_names(path: str, gathers: bool) -> dict[str, object]:
    """The public non-module names of ``path`` that Accelerate itself defines (there, or anywhere for packages)."""
    module = importlib.import_module(path)
    names = {}
    for name in dir(module):
        value = getattr(module, name)
        if name.startswith("_") or isinstance(value, types.ModuleType):
            continue
        origin = getattr(value, "__module__", None) or ""
        if (origin.startswith("accelerate") if gathers else origin == path):
            names[name] = value
    return names


def missing_names() -> dict[str, set[str]]:
    missing = {}
    for path, gathers in MODULES.items():
        ours = importlib.import_module(path.replace("accelerate", "nbaccel", 1))
        missing[path] = {n for n in public_names(path, gathers) if not hasattr(ours, n)}
    return missing


def test_accelerate_is_the_version_compared():
    import accelerate

    assert accelerate.__version__.startswith("1.16"), accelerate.__version__


def test_every_accelerate_name_exists_in_nbaccel_or_is_listed_with_its_reason():
    missing = set().union(*missing_names().values())
    assert sorted(missing - set(NOT_HERE)) == []  # an Accelerate name nbaccel lacks, not listed
    assert sorted(set(NOT_HERE) - missing) == []  # listed, but nbaccel has it now (or Accelerate dropped it)


def test_the_issue_names_are_all_here():
    """The names issue 12 found missing, at Accelerate's paths."""
    from nbaccel import (
        Accelerator,
        AcceleratorState,
        DistributedType,
        GradientState,
        PartialState,
    )

    # issue 28's names
    from nbaccel.big_modeling import SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING  # noqa: F401 - imported to show the name is there
    from nbaccel.data_loader import (
        DataLoaderShard,
        DataLoaderStateMixin,
        SkipDataLoader,  # noqa: F401 - imported to show the name is there
    )
    from nbaccel.hooks import (  # noqa: F401 - imported to show the name is there
        attach_align_device_hook,
        attach_align_device_hook_on_blocks,
        attach_layerwise_casting_hooks,
        remove_hook_from_submodules,
    )
    from nbaccel.state import ThreadLocalSharedDict, do_nothing  # noqa: F401 - imported to show the name is there
    from nbaccel.utils import (  # noqa: F401 - imported to show the name is there
        CannotPadNestedTensorWarning,
        CustomDtype,
        DDPCommunicationHookType,
        DistributedOperationException,
        align_module_device,
        check_os_kernel,
        clean_device_map,
        clear_environment,
        compute_module_total_buffer_size,
        convert_to_fp32,
        copy_tensor_to_devices,
        extract_model_from_parallel,
        extract_submodules_state_dict,
        get_max_layer_size,
        get_model_tp_size,
        get_module_size_with_ties,
        get_non_persistent_buffers,
        get_state_dict_offloaded_model,
        has_offloaded_params,
        is_namedtuple,
        listify,
        pad_input_tensors,
        patch_environment,
        retie_parameters,
        save,
        tqdm,
    )

    assert issubclass(DataLoaderShard, DataLoaderStateMixin)

    assert callable(Accelerator.join_uneven_inputs) and callable(Accelerator.trigger_sync_in_backward)
    assert {"MULTI_NPU", "MULTI_XPU", "MULTI_HPU", "MULTI_MLU"} <= {m.value for m in DistributedType}
    assert all(callable(cls._reset_state) for cls in (PartialState, AcceleratorState, GradientState))


def _parameters(value: object) -> dict[str, inspect.Parameter] | None:
    try:
        return dict(inspect.signature(value.__init__ if inspect.isclass(value) else value).parameters)
    except (TypeError, ValueError):
        return None


def signature_gaps() -> dict[str, list[str]]:
    """name -> Accelerate parameters nbaccel's version does not take, or parameters nbaccel requires and Accelerate
    lacks."""
    gaps: dict[str, list[str]] = {}
    for path, gathers in MODULES.items():
        ours = importlib.import_module(path.replace("accelerate", "nbaccel", 1))
        for name, theirs in public_names(path, gathers).items():
            if not callable(theirs) or not hasattr(ours, name):
                continue
            a, n = _parameters(theirs), _parameters(getattr(ours, name))
            if a is None or n is None:
                continue
            takes_any = any(p.kind is p.VAR_KEYWORD for p in n.values())
            named = [k for k, p in a.items() if k != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
            lacking = [f"-{k}" for k in named if k not in n and not takes_any]
            extra = [f"+{k}" for k, p in n.items() if k != "self" and k not in a and p.default is p.empty
                     and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
            if lacking or extra:
                gaps[name] = lacking + extra
    return gaps


def test_every_signature_takes_accelerates_parameters_or_is_listed():
    gaps = signature_gaps()
    assert {k: v for k, v in gaps.items() if k not in SIGNATURE_DIFFERS} == {}
    assert sorted(set(SIGNATURE_DIFFERS) - set(gaps)) == []  # listed, but it matches now


def test_the_readme_lists_every_missing_name_with_its_reason():
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    section = readme.split("## Coming from Accelerate", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", section))
    assert sorted(set(NOT_HERE) - listed) == []
    flowing = " ".join(section.split())
    for reason in set(NOT_HERE.values()):
        assert reason in flowing, reason
    for name in SIGNATURE_DIFFERS:
        assert f"`{name}`" in section, name
