"""FSDP1-style plugin options: mapped onto FSDP2 where they mean something, warned or refused where they do not."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from nbaccel import FullyShardedDataParallelPlugin
from nbaccel.errors import ConfigError
from tests.training.helpers import BlockStack, launch


@pytest.mark.parametrize("strategy,reshard", [("FULL_SHARD", True), ("SHARD_GRAD_OP", False), (1, True), ("2", False)])
def test_sharding_strategy_becomes_reshard_after_forward(strategy, reshard):
    assert FullyShardedDataParallelPlugin(sharding_strategy=strategy).reshard_after_forward is reshard
    from_file = FullyShardedDataParallelPlugin.from_config({"fsdp_sharding_strategy": strategy})
    assert from_file.reshard_after_forward is reshard


def test_torch_sharding_strategy_enum_is_taken():
    from torch.distributed.fsdp import ShardingStrategy

    plugin = FullyShardedDataParallelPlugin(sharding_strategy=ShardingStrategy.SHARD_GRAD_OP)
    assert plugin.reshard_after_forward is False


@pytest.mark.parametrize("strategy,fix", [("NO_SHARD", "DDP"), ("HYBRID_SHARD", "2-D device mesh"),
                                          ("ZERO9", "must be one of")])
def test_strategies_without_an_fsdp2_counterpart_are_refused(strategy, fix):
    with pytest.raises(ConfigError, match=fix) as info:
        FullyShardedDataParallelPlugin(sharding_strategy=strategy)
    assert info.value.key == "sharding_strategy" and "FULL_SHARD" in info.value.valid


def test_options_fsdp2_already_covers_warn_and_the_rest_are_refused():
    with pytest.warns(UserWarning, match="use_orig_params=True.*no effect under FSDP2"):
        FullyShardedDataParallelPlugin(use_orig_params=True)
    with pytest.warns(UserWarning, match="sync_module_states"):
        FullyShardedDataParallelPlugin.from_config({"fsdp_sync_module_states": "true", "fsdp_use_orig_params": "false"})
    with pytest.raises(ConfigError, match=re.escape("torch.utils.checkpoint")) as info:
        FullyShardedDataParallelPlugin(activation_checkpointing=True)
    assert info.value.key == "activation_checkpointing"
    with pytest.raises(ConfigError) as info:
        FullyShardedDataParallelPlugin.from_config({"fsdp_param_init_fn": "init"})
    assert info.value.key == "param_init_fn"


def test_set_auto_wrap_policy_takes_no_split_modules_and_checks_names():
    model = BlockStack()
    model._no_split_modules = ["Block", "NotInThisModel"]
    plugin = FullyShardedDataParallelPlugin(auto_wrap_policy="TRANSFORMER_BASED_WRAP")
    plugin.set_auto_wrap_policy(model)
    assert plugin.transformer_cls_names_to_wrap == ["Block"]
    with pytest.raises(ConfigError) as info:
        FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Missing"]).set_auto_wrap_policy(model)
    assert info.value.key == "transformer_cls_names_to_wrap" and "Block" in info.value.valid


def shard_grad_op() -> list:
    import nbaccel

    plugin = FullyShardedDataParallelPlugin(sharding_strategy="SHARD_GRAD_OP", transformer_cls_names_to_wrap=["Block"])
    accelerator = nbaccel.Accelerator(cpu=True, fsdp_plugin=plugin)
    torch.manual_seed(0)
    model = BlockStack()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses = []
    for step in range(3):
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(step))
        loss = nn.functional.mse_loss(model(x), torch.zeros(4, 1))
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_an_fsdp1_style_plugin_trains_in_two_processes():
    results = launch(shard_grad_op, 2)
    assert results[0] == results[1] and results[0][-1] < results[0][0]
