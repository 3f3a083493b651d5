"""FSDP2 (fully_shard) on 2 CPU processes: single-process losses, full-state-dict saving and loading."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

import nbaccel
from nbaccel.config import LaunchConfig
from tests.training.helpers import (
    BlockStack,
    cpu_fsdp2,
    launch,
    model_and_optimizer,
    regression_data,
    train_steps,
)


def _train(plugin: nbaccel.FullyShardedDataParallelPlugin | None, per_process_batch: int, folder: str | None = None
           ) -> dict:
    accelerator = nbaccel.Accelerator(fsdp_plugin=plugin)
    nbaccel.set_seed(0)
    model, optimizer = model_and_optimizer(kind=BlockStack, momentum=0.9)
    loader = DataLoader(regression_data(64), batch_size=per_process_batch)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = train_steps(accelerator, model, optimizer, loader)
    out = {"losses": [sum(accelerator.gather(torch.tensor([loss])).tolist()) / accelerator.num_processes
                      for loss in losses], "type": accelerator.distributed_type,
           "sharded": type(model).__name__}
    if folder is not None:
        accelerator.save_model(model, folder + "/model")
        accelerator.save_state(folder + "/state")
        before = [accelerator.gather(torch.tensor([loss]))
                  for loss in train_steps(accelerator, model, optimizer, loader)]
        accelerator.load_state(folder + "/state")
        after = [accelerator.gather(torch.tensor([loss]))
                 for loss in train_steps(accelerator, model, optimizer, loader)]
        out["reload_repeats"] = all(torch.equal(a, b) for a, b in zip(before, after))
    full = accelerator.get_state_dict(model)
    out["full_keys"] = sorted(full)
    out["full"] = {k: v.clone() for k, v in full.items()}
    return out


@cpu_fsdp2
def test_fsdp2_on_two_processes_matches_single_process_losses(tmp_path):
    single = _train(None, 16)
    plugin = nbaccel.FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"])
    results = launch(_train, 2, plugin, 8, str(tmp_path))
    r0 = results[0]
    assert r0["type"] == "FSDP" and r0["sharded"].startswith("FSDP")
    torch.testing.assert_close(torch.tensor(r0["losses"]), torch.tensor(single["losses"]), atol=1e-5, rtol=1e-5)
    # full state dict: every parameter, gathered on rank 0 (others get none), saved as safetensors
    assert r0["full_keys"] == sorted(BlockStack().state_dict())
    assert results[1]["full_keys"] == []
    saved = load_file(str(tmp_path / "model" / "model.safetensors"))
    assert sorted(saved) == r0["full_keys"]
    assert r0["reload_repeats"]


def _from_config() -> tuple:
    accelerator = nbaccel.Accelerator()
    model, optimizer = model_and_optimizer(kind=BlockStack)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator.distributed_type, type(model).__name__, accelerator.fsdp_plugin.reshard_after_forward


@cpu_fsdp2
def test_fsdp_chosen_by_the_launch_config_reads_accelerate_keys():
    config = LaunchConfig(distributed_type="FSDP", use_cpu=True, fsdp_config={
        "fsdp_version": 2, "fsdp_reshard_after_forward": False, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": "Block", "fsdp_state_dict_type": "FULL_STATE_DICT"})
    results = nbaccel.notebook_launcher(_from_config, num_processes=2, config=config, timeout=120)
    assert results[0] == "FSDP" and results[1].startswith("FSDP") and results[2] is False


def _sharded_state(folder: str) -> bool:
    plugin = nbaccel.FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT", min_num_params=10)
    accelerator = nbaccel.Accelerator(fsdp_plugin=plugin)
    nbaccel.set_seed(0)
    model, optimizer = model_and_optimizer(kind=BlockStack)
    loader = DataLoader(regression_data(32), batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    train_steps(accelerator, model, optimizer, loader)
    accelerator.save_state(folder)
    before = train_steps(accelerator, model, optimizer, loader)
    accelerator.load_state(folder)
    return train_steps(accelerator, model, optimizer, loader) == before


@cpu_fsdp2
def test_fsdp2_sharded_state_dict_round_trips(tmp_path):
    assert launch(_sharded_state, 2, str(tmp_path / "ckpt")) == {0: True, 1: True}
    assert (tmp_path / "ckpt" / "pytorch_model_fsdp_0").is_dir()


def test_fsdp_plugin_errors():
    with pytest.raises(nbaccel.ConfigError) as info:
        nbaccel.FullyShardedDataParallelPlugin(fsdp_version=1)
    assert info.value.valid == (2,)
    with pytest.raises(nbaccel.ConfigError) as info:
        nbaccel.FullyShardedDataParallelPlugin(state_dict_type="LOCAL_STATE_DICT")
    assert info.value.key == "state_dict_type"
    with pytest.raises(nbaccel.ConfigError) as info:
        nbaccel.FullyShardedDataParallelPlugin(auto_wrap_policy="EVERYTHING")
    assert info.value.key == "auto_wrap_policy"
    with pytest.raises(nbaccel.ConfigError) as info:
        nbaccel.FullyShardedDataParallelPlugin.from_config({"fsdp_sharding": "FULL"})
    assert info.value.key == "fsdp_sharding"
    plugin = nbaccel.FullyShardedDataParallelPlugin.from_config({"fsdp_reshard_after_forward": "SHARD_GRAD_OP",
                                                                 "fsdp_use_orig_params": True})
    assert plugin.reshard_after_forward is False and plugin.auto_wrap_policy == "NO_WRAP"


def _bad_wrap_names() -> None:
    plugin = nbaccel.FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["DecoderLayer"])
    accelerator = nbaccel.Accelerator(fsdp_plugin=plugin)
    accelerator.prepare(BlockStack())


def test_wrap_class_names_that_match_nothing_are_a_config_error():
    with pytest.raises(nbaccel.ConfigError) as info:
        launch(_bad_wrap_names, 2)
    assert "Block" in info.value.valid


def test_fsdp_in_a_single_process_warns_and_trains_unsharded():
    with pytest.warns(UserWarning, match="single process"):
        accelerator = nbaccel.Accelerator(fsdp_plugin=nbaccel.FullyShardedDataParallelPlugin())
    assert accelerator.distributed_type == "NO"


def _clip_norm(plugin: nbaccel.FullyShardedDataParallelPlugin | None, per_process_batch: int) -> tuple:
    accelerator = nbaccel.Accelerator(fsdp_plugin=plugin)
    model, optimizer = model_and_optimizer(kind=BlockStack)
    loader = DataLoader(regression_data(64), batch_size=per_process_batch)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    x, y = next(iter(loader))
    accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
    norm = accelerator.clip_grad_norm_(model.parameters(), 0.1)
    after = accelerator.clip_grad_norm_(model.parameters(), 1e9)
    return type(norm).__name__, norm.item(), after.item()


@cpu_fsdp2
def test_clip_grad_norm_under_fsdp2_is_the_global_norm():
    single = _clip_norm(None, 16)
    results = launch(_clip_norm, 2, nbaccel.FullyShardedDataParallelPlugin(), 8)
    for rank in (0, 1):
        kind, norm, after = results[rank]
        assert kind == "Tensor"  # a plain tensor, not a DTensor
        assert abs(norm - single[1]) < 1e-5 and abs(after - 0.1) < 1e-5


def _train_bf16(folder: str) -> dict:
    plugin = nbaccel.FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"])
    accelerator = nbaccel.Accelerator(fsdp_plugin=plugin, mixed_precision="bf16")
    nbaccel.set_seed(0)
    model, optimizer = model_and_optimizer(kind=BlockStack)
    model.to(torch.bfloat16)  # loaded in bf16: prepare keeps fp32 master weights, as Accelerate does
    loader = DataLoader(regression_data(64), batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    seen: list[torch.dtype] = []
    hook = model.blocks[0].linear.register_forward_pre_hook(lambda module, args: seen.append(module.weight.dtype))
    epochs = [sum(train_steps(accelerator, model, optimizer, loader)) for _ in range(5)]
    hook.remove()
    accelerator.save_model(model, folder)
    policy = accelerator.fsdp_plugin.mixed_precision_policy
    return {"epochs": epochs, "compute_dtypes": set(seen), "master_dtypes": {p.dtype for p in model.parameters()},
            "policy": (policy.param_dtype, policy.reduce_dtype)}


@cpu_fsdp2
def test_fsdp2_with_bf16_computes_in_bf16_and_saves_fp32(tmp_path):
    results = launch(_train_bf16, 2, str(tmp_path / "model"))
    for rank in (0, 1):
        r = results[rank]
        assert r["policy"] == (torch.bfloat16, torch.bfloat16)
        assert r["compute_dtypes"] == {torch.bfloat16}  # parameters gathered in bf16 for the forward
        assert r["master_dtypes"] == {torch.float32}  # the optimizer updates fp32 shards
        assert r["epochs"][-1] < 0.1 * r["epochs"][0]  # it learns (summed loss per epoch)
    saved = load_file(str(tmp_path / "model" / "model.safetensors"))
    assert sorted(saved) == sorted(BlockStack().state_dict())
    assert {t.dtype for t in saved.values()} == {torch.float32}


def test_fsdp_mixed_precision_policy_from_names_and_dicts():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    plugin = nbaccel.FullyShardedDataParallelPlugin(mixed_precision_policy={"param_dtype": "bf16",
                                                                            "reduce_dtype": torch.float32})
    assert plugin.mixed_precision_policy == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plugin.set_mixed_precision("fp16")  # a policy the user gave is kept
    assert plugin.mixed_precision_policy.param_dtype == torch.bfloat16
    with pytest.raises(nbaccel.ConfigError) as info:
        nbaccel.FullyShardedDataParallelPlugin(mixed_precision_policy={"buffer_dtype": torch.bfloat16})
    assert info.value.key == "mixed_precision_policy" and "param_dtype" in info.value.valid
    with pytest.raises(nbaccel.ConfigError) as info:
        nbaccel.FullyShardedDataParallelPlugin(mixed_precision_policy="fp8")
    assert info.value.value == "fp8" and info.value.valid == ["bf16", "fp16", "fp32"]


def test_fsdp_plugin_errors_name_the_setting_and_the_valid_values():
    from nbaccel.errors import ConfigError
    from nbaccel.training.fsdp import _wrap_targets

    with pytest.raises(ConfigError) as info:
        nbaccel.FullyShardedDataParallelPlugin(mixed_precision_policy=3)
    assert info.value.key == "mixed_precision_policy" and "bf16" in info.value.valid
    plugin = nbaccel.FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["NoSuchBlock"])
    with pytest.raises(ConfigError) as info:
        _wrap_targets(torch.nn.Sequential(torch.nn.Linear(2, 2)), plugin)
    assert "matches no submodule of Sequential" in str(info.value) and "'Linear'" in str(info.value)
