"""Balanced budgets and device maps with faked GPUs (CUDA is never touched), against Accelerate."""

from __future__ import annotations

import pytest
import torch

import nbaccel.hardware
from nbaccel.big_modeling import (
    get_balanced_memory,
    get_max_memory,
    infer_auto_device_map,
)
from nbaccel.big_modeling import sizes as sizes_module
from nbaccel.big_modeling.device_map import resolve_device_map
from tests.big_modeling.helpers import empty_model

BLOCK = 4480  # one helpers.Block in fp32
MODEL = 32 * 16 * 4 + 64 * 4 + 4 * BLOCK + 32 * 4  # embed, positions, blocks, norm: 20352 B
CPU = 10**9


@pytest.fixture
def fake_gpus(monkeypatch):
    """``fake_gpus(free_0, free_1, ...)``: that many GPUs with that much free memory each."""

    def fake(*free: int) -> None:
        monkeypatch.setattr(nbaccel.hardware, "cuda_device_count", lambda: len(free))
        monkeypatch.setattr(sizes_module, "_free_gpu_memory", lambda i: free[i])
        monkeypatch.setattr(sizes_module, "_available_cpu_memory", lambda: CPU)

    yield fake
    assert not torch.cuda.is_initialized()


def _accelerate_balanced(budget, no_split, low_zero):
    accelerate_utils = pytest.importorskip("accelerate.utils")
    return accelerate_utils.get_balanced_memory(empty_model(), dict(budget), no_split,
                                                low_zero=low_zero)


@pytest.mark.parametrize("low_zero", [False, True])
@pytest.mark.parametrize("no_split", [None, ["Block"]])
@pytest.mark.parametrize("free", [(15_000, 12_000), (9_000, 9_000, 9_000, 30_000)])
def test_balanced_budgets_are_accelerates(fake_gpus, free, no_split, low_zero):
    fake_gpus(*free)
    measured = get_balanced_memory(empty_model(), None, no_split, low_zero=low_zero)
    given = get_balanced_memory(empty_model(), {**dict(enumerate(free)), "cpu": CPU}, no_split,
                                low_zero=low_zero)
    assert measured == given == _accelerate_balanced(get_max_memory(), no_split, low_zero)
    assert given[len(free) - 1] == free[-1]  # the last GPU keeps its whole budget


def test_balanced_budgets_in_numbers(fake_gpus):
    fake_gpus(15_000, 12_000)
    # half the model (10176 B) plus 1.25 x one block (5600 B) on GPU 0; GPU 1 keeps all
    assert get_balanced_memory(empty_model(), None, ["Block"]) == {0: 15_000, 1: 12_000,
                                                                   "cpu": CPU}
    fake_gpus(30_000, 12_000)
    assert get_balanced_memory(empty_model(), None, ["Block"]) == {0: 15_776, 1: 12_000,
                                                                   "cpu": CPU}
    # without a no-split class the headroom is 1.25 x the mean leaf module: 14 leaves (embed,
    # 4 x norm/up/down, norm; the tied head holds nothing of its own) of 19840 B in all
    assert get_balanced_memory(empty_model(), None)[0] == MODEL // 2 + int(1.25 * (19840 // 14))
    # balanced_low_0: GPU 0 takes only what the others cannot
    fake_gpus(30_000, 9_000, 9_000)
    assert get_balanced_memory(empty_model(), None, ["Block"], low_zero=True) == {
        0: MODEL - 2 * 9_000, 1: 9_000, 2: 9_000, "cpu": CPU}


def test_one_measured_gpu_keeps_a_tenth_free(fake_gpus):
    fake_gpus(50_000)
    assert get_balanced_memory(empty_model(), None, ["Block"], low_zero=True) == {
        0: 45_000, "cpu": CPU}
    # a budget given by hand is the user's to choose
    assert get_balanced_memory(empty_model(), {0: 50_000}, ["Block"]) == {0: 50_000}


def test_buffers_of_offloaded_blocks_do_not_change_the_map_but_warn(fake_gpus):
    fake_gpus(0, 0)  # budgets given below; only the GPU count matters
    budget = {0: 2048 + 2 * BLOCK, 1: 2 * BLOCK, "cpu": CPU}
    # GPU 0 holds the embedding with its tied head, one block and room to run one offloaded
    # block, as in Accelerate
    expected = {"embed": 0, "blocks.0": 0, "blocks.1": 1, "blocks.2": 1, "blocks.3": "cpu",
                "norm": "cpu", "head": 0, "positions": "cpu"}
    assert infer_auto_device_map(empty_model(), budget, ["Block"], offload_buffers=True) == expected
    # by default the offloaded blocks' buffers stay on the execution device while the model runs;
    # when they fit beside no GPU's load (here GPU 1 had no budget left) a warning says so
    tight = {0: 2048 + 2 * BLOCK, 1: 2 * BLOCK, "cpu": CPU}
    assert infer_auto_device_map(empty_model(), tight, ["Block"]) == expected
    tight = {0: 2048 + 2 * BLOCK, "cpu": CPU}
    with pytest.warns(UserWarning, match="offload_buffers=True"):
        infer_auto_device_map(empty_model(), tight, ["Block"])


def _accelerate_map(model, strategy, budget):
    accelerate_utils = pytest.importorskip("accelerate.utils")
    if strategy != "sequential":
        budget = accelerate_utils.get_balanced_memory(model, dict(budget), ["Block"],
                                                      low_zero=strategy == "balanced_low_0")
    return dict(accelerate_utils.infer_auto_device_map(model, dict(budget), ["Block"]))


STRATEGIES = ["auto", "balanced", "balanced_low_0", "sequential"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategies_fill_gpu_0_then_gpu_1_then_cpu_then_disk(fake_gpus, strategy):
    fake_gpus(0, 0)
    # an untied head, placed in model order (a tied one goes with its embedding)
    model = empty_model(blocks=8, tied=False)
    budget = {0: 12_000, 1: 12_000, "cpu": 12_000}
    device_map = resolve_device_map(model, strategy, budget, ["Block"], offload_buffers=True)
    # GPU 0 and the CPU keep one block's room to run offloaded blocks; GPU 1 needs none
    assert device_map == {"embed": 0, "blocks.0": 0, "blocks.1": 1, "blocks.2": 1,
                          "blocks.3": "cpu", "blocks.4": "disk", "blocks.5": "disk",
                          "blocks.6": "disk", "blocks.7": "disk", "norm": "disk",
                          "head": "disk", "positions": "disk"}
    assert device_map == _accelerate_map(model, strategy, budget)


def test_balanced_low_0_keeps_gpu_0_lighter(fake_gpus):
    fake_gpus(0, 0)
    model = empty_model(blocks=8, tied=False)
    budget = {0: 30_000, 1: 30_000, "cpu": CPU}
    maps = {s: resolve_device_map(model, s, budget, ["Block"], offload_buffers=True)
            for s in STRATEGIES}
    gpu_0 = {s: [n for n, d in m.items() if d == 0] for s, m in maps.items()}
    assert gpu_0["balanced_low_0"] == ["embed"]
    assert maps["balanced_low_0"] == _accelerate_map(model, "balanced_low_0", budget)
    # the others spread the model over both GPUs: sequential fills GPU 0 first, keeping one
    # block's room even though nothing is offloaded (as Accelerate does); auto and balanced
    # stop at an even share plus one block of headroom
    assert gpu_0["sequential"] == ["embed", *(f"blocks.{i}" for i in range(5))]
    assert gpu_0["auto"] == gpu_0["balanced"] == ["embed", *(f"blocks.{i}" for i in range(4))]
    assert all(maps[s] == _accelerate_map(model, s, budget) for s in STRATEGIES)
    assert set(maps["auto"].values()) == {0, 1}


def test_reserved_slots_keep_room_for_streamed_layers_on_the_first_gpu(fake_gpus):
    fake_gpus(10**9)
    budget = {0: 3 * BLOCK, "cpu": CPU}
    one = resolve_device_map(empty_model(), "sequential", budget, ["Block"])
    three = resolve_device_map(empty_model(), "sequential", budget, ["Block"], reserved_slots=3)

    def on_gpu(device_map: dict) -> list[str]:
        return [k for k, d in device_map.items() if d == 0]

    # with room for one block in flight the GPU holds more than with room for three
    assert len(on_gpu(three)) < len(on_gpu(one))
    assert "cpu" in three.values()
    everything = {0: 10**8, "cpu": CPU}  # nothing offloaded: nothing kept back
    assert resolve_device_map(empty_model(), "sequential", everything, ["Block"], reserved_slots=3) \
        == resolve_device_map(empty_model(), "sequential", everything, ["Block"])


def _linears() -> torch.nn.Module:
    from nbaccel.big_modeling import init_empty_weights

    with init_empty_weights():  # 8 x 263168 B, the model of scripts/check_gpu.py's big-model-offload
        return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])


def test_a_tiny_first_gpu_budget_keeps_the_gpu_as_the_execution_device(fake_gpus):
    """Reserving 3 slots used to take GPU 0's only layer: {first: cpu, rest: disk}, and dispatch
    then ran every layer on the CPU. Now the map keeps Accelerate's GPU entry, fewer slots are
    kept with a warning, and the plan names GPU 0 as where offloaded layers run."""
    fake_gpus(80 * 2**30)
    budget = {0: "600KiB", "cpu": "600KiB"}
    with pytest.warns(UserWarning, match="room for only 1 of 3 offload slots"):
        assert resolve_device_map(_linears(), "auto", budget, reserved_slots=3)["0"] == 0
    from nbaccel.big_modeling.device_map import plan_device_map

    with pytest.warns(UserWarning, match="room for only 1 of 3 offload slots") as caught:
        plan = plan_device_map(_linears(), "auto", budget, reserved_slots=3)
    assert plan.device_map["0"] == 0 and plan.device_map["1"] == "cpu" and plan.slots == 1
    assert plan.main_device == 0
    assert "Fix: raise max_memory[0] by 526336 bytes" in str(caught[0].message)
    assert plan.device_map == resolve_device_map(_linears(), "auto", budget)  # Accelerate's map
    with pytest.warns(UserWarning, match="room for only 1 of 3"):
        tiny = plan_device_map(_linears(), "auto", {0: "100KiB", "cpu": "600KiB"}, reserved_slots=3)
    assert 0 not in tiny.device_map.values() and tiny.main_device == 0

