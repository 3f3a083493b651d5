"""Balanced budgets and device maps with faked GPUs (CUDA is never touched), against Accelerate."""

from __future__ import annotations

import pytest
import torch

import nbaccel.environment
from nbaccel.big_modeling import get_balanced_memory, get_max_memory
from nbaccel.big_modeling import sizes as sizes_module
from tests.big_modeling.helpers import empty_model

BLOCK = 4480  # one helpers.Block in fp32
MODEL = 32 * 16 * 4 + 64 * 4 + 4 * BLOCK + 32 * 4  # embed, positions, blocks, norm: 20352 B
CPU = 10**9


@pytest.fixture
def fake_gpus(monkeypatch):
    """``fake_gpus(free_0, free_1, ...)``: that many GPUs with that much free memory each."""

    def fake(*free: int) -> None:
        monkeypatch.setattr(nbaccel.environment, "cuda_device_count", lambda: len(free))
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
