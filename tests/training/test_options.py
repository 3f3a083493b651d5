"""Accelerator options and plugins: validation, conflicts, DeepSpeed without deepspeed, compatibility shims."""

from __future__ import annotations

import importlib.util
import json
from datetime import timedelta

import pytest
import torch

import nbaccel
from nbaccel.config import LaunchConfig

no_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is not None, reason="deepspeed is installed")


@no_deepspeed
def test_deepspeed_plugin_without_deepspeed_is_a_clear_error():
    plugin = nbaccel.DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=4)
    assert plugin.deepspeed_config == {"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4}
    with pytest.raises(nbaccel.MissingDependencyError) as info:
        nbaccel.Accelerator(deepspeed_plugin=plugin)
    assert isinstance(info.value, ImportError)
    assert (info.value.package, info.value.install) == ("deepspeed", "pip install deepspeed")


def _make_accelerator() -> str:
    return nbaccel.Accelerator().distributed_type


@no_deepspeed
def test_deepspeed_chosen_by_the_launch_config_fails_in_the_workers_with_the_same_error():
    config = LaunchConfig(distributed_type="DEEPSPEED", deepspeed_config={"zero_stage": 3})
    with pytest.raises(nbaccel.MissingDependencyError):
        nbaccel.notebook_launcher(_make_accelerator, num_processes=2, config=config, timeout=60)


def test_deepspeed_auto_values_are_filled_from_nbaccel_settings():
    from nbaccel.training.deepspeed_engine import build_config

    config = build_config({"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto",
                           "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3}},
                          micro_batch_size=8, accumulation_steps=2, num_processes=4, mixed_precision="bf16",
                          zero_optimizer=True)
    assert config["train_micro_batch_size_per_gpu"] == 8 and config["gradient_accumulation_steps"] == 2
    assert config["train_batch_size"] == 64 and config["gradient_clipping"] == 0.0
    assert config["bf16"] == {"enabled": True} and config["fp16"] == {"enabled": False}
    assert config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    assert config["zero_allow_untested_optimizer"] is True
    kept = build_config({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 3}, micro_batch_size=None,
                        accumulation_steps=1, num_processes=4, mixed_precision="no", zero_optimizer=False)
    assert kept["train_batch_size"] == 12 and kept["train_micro_batch_size_per_gpu"] == 3


def test_deepspeed_plugin_reads_a_json_file_and_rejects_other_things(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2}))
    plugin = nbaccel.DeepSpeedPlugin(hf_ds_config=str(path), zero_stage=3, offload_param_device="cpu",
                                     gradient_clipping=1.0)
    assert plugin.deepspeed_config == {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
                                       "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    assert nbaccel.DeepSpeedPlugin.from_config({"zero_stage": 1}).deepspeed_config["zero_optimization"]["stage"] == 1
    with pytest.raises(nbaccel.ConfigError) as info:
        nbaccel.DeepSpeedPlugin(hf_ds_config=42)
    assert info.value.key == "hf_ds_config"
    with pytest.raises(nbaccel.ConfigError) as info:
        nbaccel.DeepSpeedPlugin(zero_stage=4)
    assert info.value.valid == (0, 1, 2, 3)


def test_kwargs_handlers_are_checked():
    with pytest.raises(nbaccel.ConfigError) as info:
        nbaccel.Accelerator(kwargs_handlers=[{"find_unused_parameters": True}])
    assert info.value.key == "kwargs_handlers"
    with pytest.raises(nbaccel.ConfigError, match="two GradScalerKwargs"):
        nbaccel.Accelerator(kwargs_handlers=[nbaccel.GradScalerKwargs(), nbaccel.GradScalerKwargs()])
    handler = nbaccel.InitProcessGroupKwargs(timeout=timedelta(seconds=30))
    assert nbaccel.Accelerator(kwargs_handlers=[handler]).num_processes == 1
    assert nbaccel.GradScalerKwargs(growth_interval=10).to_kwargs() == {"growth_interval": 10}


def test_conflicting_arguments_are_config_errors():
    with pytest.raises(nbaccel.ConfigError) as info:
        nbaccel.Accelerator(gradient_accumulation_steps=2,
                            gradient_accumulation_plugin=nbaccel.GradientAccumulationPlugin(num_steps=2))
    assert info.value.key == "gradient_accumulation_steps"
    with pytest.raises(nbaccel.ConfigError) as info:
        nbaccel.Accelerator(split_batches=True, dataloader_config=nbaccel.DataLoaderConfiguration())
    assert info.value.key == "split_batches"
    with pytest.raises(nbaccel.ConfigError) as info:
        nbaccel.GradientAccumulationPlugin(num_steps=0)
    assert info.value.value == 0
    with pytest.raises(nbaccel.ConfigError):
        nbaccel.ProjectConfiguration("x", total_limit=-1)


def test_shorthand_arguments_and_compatibility_shims():
    accelerator = nbaccel.Accelerator(split_batches=True, even_batches=False, project_dir="runs/a")
    assert accelerator.split_batches and not accelerator.even_batches and accelerator.project_dir == "runs/a"
    assert accelerator.project_configuration.logging_dir == "runs/a"
    tracked = nbaccel.Accelerator()
    tracked.init_trackers("run", config={"lr": 1})  # no trackers chosen: nothing is written, as in Accelerate
    tracked.log({"loss": 1.0}, step=1)
    tracked.end_training()
    assert "num_processes=1" in repr(tracked) and "GradientState(num_steps=1" in repr(tracked.gradient_state)
    assert tracked.use_distributed is False and tracked.optimizer_step_was_skipped is False
    assert nbaccel.Accelerator(cpu=True).device.type == "cpu"


def test_cpu_true_after_the_state_chose_another_device_is_a_config_error(monkeypatch):
    state = nbaccel.ProcessState()
    monkeypatch.setattr(state, "device", torch.device("cuda", 0))  # as if an earlier Accelerator took a GPU
    with pytest.raises(nbaccel.ConfigError, match="already set up on cuda:0") as info:
        nbaccel.Accelerator(cpu=True)
    assert info.value.key == "cpu" and "restart the kernel" in str(info.value)
    assert nbaccel.Accelerator().device == torch.device("cuda", 0)  # without cpu=True the state is reused


def test_fp16_on_an_xla_device_is_a_config_error_naming_bf16():
    from nbaccel.training.precision import make_grad_scaler

    with pytest.raises(nbaccel.ConfigError, match="mixed_precision='bf16'") as info:
        make_grad_scaler("fp16", torch.device("xla", 0))
    assert info.value.valid == ("no", "bf16")
    assert make_grad_scaler("bf16", torch.device("xla", 0)) is None


def test_deepspeed_argument_checks_come_before_importing_deepspeed():
    from nbaccel.training.deepspeed_engine import prepare_deepspeed
    from nbaccel.training.gradient_state import GradientState
    from nbaccel.training.prepared import PreparedObjects

    models = (torch.nn.Linear(1, 1), torch.nn.Linear(1, 1))
    prepared = PreparedObjects()
    with pytest.raises(nbaccel.ConfigError, match="one model with one optimizer") as info:
        prepare_deepspeed(models, prepared, base_config={}, process=nbaccel.ProcessState(),
                          gradient_state=GradientState(), mixed_precision="no", split_batches=False,
                          prepare_data_loader=lambda loader: loader)
    assert info.value.value == (2, 0) and not prepared.models
