"""FSDP2 prepare on 2 CPU processes: shard first, upcast each shard after, and models built on the meta device."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import nbaccel
from tests.training.helpers import (
    BlockStack,
    ScaledStack,
    Unresettable,
    cpu_fsdp2,
    launch,
    regression_data,
    train_steps,
)

pytestmark = cpu_fsdp2


def _build(kind: type[torch.nn.Module], on_meta: bool, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if on_meta:
        with torch.device("meta"):
            return kind()
    return kind()


def _train_built(kind: type[torch.nn.Module], meta_ranks: tuple[int, ...], plugin_kwargs: dict | None = None) -> dict:
    """Build the model (on meta where this rank is listed), prepare, report the weights and an epoch's losses."""
    accelerator = nbaccel.Accelerator(fsdp_plugin=nbaccel.FullyShardedDataParallelPlugin(
        transformer_cls_names_to_wrap=["Block"], **(plugin_kwargs or {})))
    rank = accelerator.process_index
    model = _build(kind, rank in meta_ranks, seed=rank if plugin_kwargs else 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(regression_data(64), batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    left_on_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    weights = {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    losses = [sum(accelerator.gather(torch.tensor([loss])).tolist()) / 2
              for loss in train_steps(accelerator, model, optimizer, loader)]
    return {"meta": left_on_meta, "weights": weights, "buffers": buffers, "losses": losses}


def _single(kind: type[torch.nn.Module]) -> dict:
    accelerator = nbaccel.Accelerator()
    model = _build(kind, False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(regression_data(64), batch_size=16)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    return {"weights": {k: v.clone() for k, v in model.state_dict().items()},
            "losses": train_steps(accelerator, model, optimizer, loader)}


@pytest.mark.parametrize("meta_ranks", [(1,), ()])
def test_ranks_built_on_meta_get_rank_0s_weights_and_train_as_one_process(meta_ranks):
    single = _single(ScaledStack)
    results = launch(_train_built, 2, ScaledStack, meta_ranks)
    for rank in (0, 1):
        assert results[rank]["meta"] == []
        assert torch.equal(results[rank]["buffers"]["scale"], torch.tensor([0.5]))  # persistent=False, broadcast
    assert sorted(results[0]["weights"]) == sorted(single["weights"])
    for name, value in single["weights"].items():
        assert torch.equal(results[0]["weights"][name], value), name
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(single["losses"]),
                               atol=1e-5, rtol=1e-5)


def test_cpu_ram_efficient_loading_gives_every_rank_rank_0s_weights():
    # each rank builds with its own seed: only rank 0's weights may survive prepare
    results = launch(_train_built, 2, BlockStack, (), {"cpu_ram_efficient_loading": "true"})
    torch.manual_seed(0)
    expected = BlockStack().state_dict()
    for name, value in expected.items():
        assert torch.equal(results[0]["weights"][name], value), name


def test_a_model_on_meta_everywhere_is_initialized_by_reset_parameters():
    results = launch(_train_built, 2, BlockStack, (0, 1))
    r0 = results[0]
    assert r0["meta"] == [] and results[1]["meta"] == []
    assert sorted(r0["weights"]) == sorted(BlockStack().state_dict())
    for name, value in r0["weights"].items():
        assert torch.isfinite(value).all() and value.abs().sum() > 0, name  # initialized, not left empty
    assert r0["losses"][-1] < r0["losses"][0]


def _unresettable() -> None:
    accelerator = nbaccel.Accelerator(fsdp_plugin=nbaccel.FullyShardedDataParallelPlugin())
    with torch.device("meta"):
        model = Unresettable()
    accelerator.prepare(model)


def test_a_meta_model_nothing_can_initialize_is_a_config_error():
    with pytest.raises(nbaccel.ConfigError) as info:
        launch(_unresettable, 2)
    assert info.value.key == "model" and info.value.value == ["<root> (Unresettable)"]
    assert "Fix:" in str(info.value)


def _dtypes_when_sharded() -> dict:
    import torch.distributed.fsdp as fsdp

    seen: list[set] = []
    real = fsdp.fully_shard

    def spy(module: torch.nn.Module, **kwargs):
        seen.append({p.dtype for p in module.parameters()})
        return real(module, **kwargs)

    fsdp.fully_shard = spy
    try:
        accelerator = nbaccel.Accelerator(fsdp_plugin=nbaccel.FullyShardedDataParallelPlugin(
            transformer_cls_names_to_wrap=["Block"]), mixed_precision="bf16")
        torch.manual_seed(0)
        model = BlockStack().to(torch.bfloat16)
        model = accelerator.prepare(model)
    finally:
        fsdp.fully_shard = real
    shards = {(p.dtype, tuple(p.to_local().shape)) for p in model.blocks[0].parameters()}
    return {"seen": seen, "shards": shards}


def test_parameters_are_sharded_as_given_and_upcast_shard_by_shard():
    results = launch(_dtypes_when_sharded, 2)
    for rank in (0, 1):
        # fully_shard got the bf16 parameters as they were (not upcast or moved first)...
        assert results[rank]["seen"] and all(s == {torch.bfloat16} for s in results[rank]["seen"])
        # ...and each rank's float32 master weights are its half of each parameter
        assert results[rank]["shards"] == {(torch.float32, (4, 8)), (torch.float32, (4,))}
