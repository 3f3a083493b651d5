"""Data-parallel training over gloo matches a single-process baseline with the same global batch."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import nbaccel
from tests.training.helpers import (
    flat_weights,
    launch,
    model_and_optimizer,
    regression_data,
    train_steps,
)


def _train(per_process_batch: int, accumulation: int = 1, epochs: int = 2) -> dict:
    # As in Accelerate, the default shuffle depends on the process count (one process reseeds its
    # sampler from the global RNG each pass); the seedable sampler gives every count one order.
    config = nbaccel.DataLoaderConfiguration(use_seedable_sampler=True)
    accelerator = nbaccel.Accelerator(gradient_accumulation_steps=accumulation, dataloader_config=config)
    nbaccel.set_seed(0)
    model, optimizer = model_and_optimizer()
    loader = DataLoader(regression_data(64), batch_size=per_process_batch, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for _ in range(epochs):
        losses += train_steps(accelerator, model, optimizer, loader)
    return {"weights": flat_weights(accelerator.unwrap_model(model)), "losses": losses,
            "type": accelerator.distributed_type, "n": accelerator.num_processes,
            "wrapped": type(model).__name__, "group": torch.distributed.is_initialized()}


@pytest.mark.parametrize("num_processes", [2, 4])
def test_ddp_ends_with_the_single_process_weights(num_processes):
    single = _train(per_process_batch=16)
    results = launch(_train, num_processes, 16 // num_processes)
    assert results[0]["type"] == "MULTI_CPU" and results[0]["n"] == num_processes and results[0]["group"]
    assert results[0]["wrapped"] == "DistributedDataParallel"
    assert single["type"] == "NO" and single["wrapped"] == "TinyMLP"
    for rank in range(num_processes):
        torch.testing.assert_close(results[rank]["weights"], single["weights"], atol=1e-5, rtol=0)
    # each rank's loss is over its part of the global batch; their mean is the global batch's loss
    mean = [sum(step) / num_processes for step in zip(*(results[r]["losses"] for r in range(num_processes)))]
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(single["losses"]), atol=1e-4, rtol=1e-4)


def test_accumulation_across_two_processes_equals_the_bigger_batch():
    single = _train(per_process_batch=32)
    results = launch(_train, 2, 8, 2)  # 2 ranks x 8 x 2 micro-batches = 32
    torch.testing.assert_close(results[0]["weights"], single["weights"], atol=1e-5, rtol=0)


def _no_args_state() -> tuple:
    accelerator = nbaccel.Accelerator()
    return (accelerator.num_processes, accelerator.process_index, accelerator.local_process_index,
            accelerator.is_main_process, accelerator.is_local_main_process, accelerator.is_last_process,
            accelerator.distributed_type, str(accelerator.device), accelerator.mixed_precision,
            torch.distributed.get_world_size())


def test_accelerator_made_before_a_launch_does_not_leak_into_the_workers():
    before = nbaccel.Accelerator()
    assert before.num_processes == 1
    results = launch(_no_args_state, 4)
    assert results == {r: (4, r, r, r == 0, r == 0, r == 3, "MULTI_CPU", "cpu", "no", 4) for r in range(4)}
    assert nbaccel.Accelerator().num_processes == 1  # the notebook's own state is untouched


def test_mixed_precision_of_the_launch_reaches_the_accelerator():
    results = nbaccel.notebook_launcher(_no_args_state, num_processes=2, mixed_precision="bf16", use_cpu=True,
                                        return_all=True, timeout=120)
    assert [r[8] for r in results.values()] == ["bf16", "bf16"]
