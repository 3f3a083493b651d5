"""The training step: accumulation, optimizer and scheduler rules, mixed precision, clipping, prepare."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import nbaccel
from tests.training.helpers import (
    TinyMLP,
    flat_weights,
    launch,
    model_and_optimizer,
    regression_data,
    train_steps,
)


def _weights_after(batch_size: int, accumulation: int, **kwargs) -> torch.Tensor:
    accelerator = nbaccel.Accelerator(gradient_accumulation_steps=accumulation, **kwargs)
    model, optimizer = model_and_optimizer()
    loader = DataLoader(regression_data(64), batch_size=batch_size)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    train_steps(accelerator, model, optimizer, loader)
    return flat_weights(model)


def test_gradient_accumulation_equals_the_bigger_batch():
    torch.testing.assert_close(_weights_after(4, 4), _weights_after(16, 1), atol=1e-6, rtol=0)
    plugin = nbaccel.GradientAccumulationPlugin(num_steps=4)
    torch.testing.assert_close(_weights_after(4, 1, gradient_accumulation_plugin=plugin), _weights_after(16, 1),
                               atol=1e-6, rtol=0)


def test_optimizer_does_not_step_or_zero_while_accumulating():
    accelerator = nbaccel.Accelerator(gradient_accumulation_steps=3)
    model, optimizer = accelerator.prepare(*model_and_optimizer())
    x, y = regression_data(8).tensors
    start = flat_weights(model)
    syncs = []
    for step in range(3):
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            syncs.append(accelerator.sync_gradients)
            optimizer.step()
            optimizer.zero_grad()
            if step < 2:
                assert torch.equal(flat_weights(model), start) and model.fc1.weight.grad is not None
    assert syncs == [False, False, True]
    assert not torch.equal(flat_weights(model), start) and model.fc1.weight.grad is None


def test_the_last_batch_of_the_loader_always_syncs():
    accelerator = nbaccel.Accelerator(gradient_accumulation_steps=4)
    model, optimizer = model_and_optimizer()
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(regression_data(24), batch_size=4))
    syncs = []
    for _x, _y in loader:
        with accelerator.accumulate(model):
            syncs.append(accelerator.sync_gradients)
    assert syncs == [False, False, False, True, False, True]


def _lrs(accumulation: int, split: bool, step_with_optimizer: bool = True) -> list[float]:
    accelerator = nbaccel.Accelerator(gradient_accumulation_steps=accumulation, split_batches=split,
                                      step_scheduler_with_optimizer=step_with_optimizer)
    model, optimizer = model_and_optimizer(lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    loader = DataLoader(regression_data(32), batch_size=4)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    lrs = []
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        lrs.append(round(scheduler.get_last_lr()[0], 4))
    return lrs


def test_scheduler_steps_once_per_process_per_optimizer_step():
    results = launch(_lrs, 2, 1, False)  # 4 batches per rank, 2 schedule steps each
    assert results[0] == [round(1 / 3, 4), 0.2, round(1 / 7, 4), round(1 / 9, 4)]
    split = launch(_lrs, 2, 1, True)     # split batches: one schedule step per optimizer step
    assert split[0] == [0.5, round(1 / 3, 4), 0.25, 0.2, round(1 / 6, 4), round(1 / 7, 4), 0.125, round(1 / 9, 4)]


def test_scheduler_waits_while_accumulating():
    assert _lrs(2, False) == [1.0, 0.5, 0.5, round(1 / 3, 4), round(1 / 3, 4), 0.25, 0.25, 0.2]
    with pytest.warns(UserWarning, match="before `optimizer.step"):  # torch's own warning: stepped without an update
        assert _lrs(2, False, step_with_optimizer=False)[:2] == [0.5, round(1 / 3, 4)]


def test_fp16_overflow_skips_the_step_and_the_scheduler():
    accelerator = nbaccel.Accelerator(mixed_precision="fp16",
                                      kwargs_handlers=[nbaccel.GradScalerKwargs(init_scale=1024.0)])
    assert accelerator.scaler.get_scale() == 1024.0
    model, optimizer = model_and_optimizer()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    x, y = regression_data(8).tensors
    start = flat_weights(model)
    accelerator.backward(model(x).sum() * float("inf"))
    optimizer.step()
    scheduler.step()
    assert optimizer.step_was_skipped and accelerator.optimizer_step_was_skipped
    assert torch.equal(flat_weights(model), start) and scheduler.get_last_lr() == [0.05]
    optimizer.zero_grad()
    accelerator.backward(nn.functional.mse_loss(model(x), y))
    norm = accelerator.clip_grad_norm_(model.parameters(), 1e6)  # unscales first: a real, finite norm
    accelerator.clip_grad_norm_(model.parameters(), 1e6)          # a second clip does not unscale twice
    optimizer.step()
    scheduler.step()
    assert torch.isfinite(norm) and norm < 1e4
    assert not optimizer.step_was_skipped and scheduler.get_last_lr() == [0.025]


def test_bf16_autocasts_the_forward_and_returns_fp32():
    accelerator = nbaccel.Accelerator(mixed_precision="bf16")
    assert accelerator.scaler is None
    model = accelerator.prepare(TinyMLP())
    inner = []
    model.fc1.register_forward_hook(lambda m, i, o: inner.append(o.dtype))
    out = model(torch.randn(2, 4))
    assert inner == [torch.bfloat16] and out.dtype == torch.float32
    with accelerator.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with accelerator.autocast(nbaccel.AutocastKwargs(enabled=False)):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    plain = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    inner.clear()
    plain(torch.randn(2, 4))
    assert inner == [torch.float32] and "forward" not in plain.__dict__


def test_invalid_mixed_precision_is_a_config_error():
    with pytest.raises(nbaccel.ConfigError) as info:
        nbaccel.Accelerator(mixed_precision="fp8")  # a CPU process cannot run fp8 matmuls
    assert "compute capability 8.9 or newer" in str(info.value) and info.value.valid == ("no", "fp16", "bf16")
    with pytest.raises(nbaccel.ConfigError) as info:
        nbaccel.Accelerator(mixed_precision="half")
    assert info.value.valid == ("no", "fp16", "bf16", "fp8")


def test_clipping_by_norm_and_value():
    accelerator = nbaccel.Accelerator()
    model, _optimizer = accelerator.prepare(*model_and_optimizer())
    x, y = regression_data(8).tensors
    accelerator.backward(nn.functional.mse_loss(model(x), y) * 100)
    norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
    total = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm()
    assert norm > 1.0 and abs(total.item() - 1.0) < 1e-4
    accelerator.clip_grad_value_(model.parameters(), 0.01)
    assert max(p.grad.abs().max().item() for p in model.parameters()) <= 0.01
    accelerator.clip_grad_norm_(model.fc1.weight, 0.5)


def test_prepare_keeps_order_and_passes_through_what_it_does_not_know():
    accelerator = nbaccel.Accelerator()
    model, optimizer = model_and_optimizer()
    loader = DataLoader(regression_data(8), batch_size=4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    out = accelerator.prepare(scheduler, "extra", loader, optimizer, model)
    assert [type(o).__name__ for o in out] == ["AcceleratedScheduler", "str", "DataLoaderShard",
                                               "AcceleratedOptimizer", "TinyMLP"]
    assert out[0].optimizers[0] is out[3]  # the scheduler follows the prepared optimizer
    again = accelerator.prepare(out[3])
    assert again is out[3]
    with pytest.raises(nbaccel.ConfigError) as info:
        accelerator.prepare(model, optimizer, device_placement=[True])
    assert info.value.key == "device_placement"
    kept = accelerator.prepare(TinyMLP(), device_placement=[False])
    assert kept.fc1.weight.device.type == "cpu"
    assert accelerator.no_sync(model).__enter__() is None
    assert accelerator.free_memory(model, optimizer) == [None, None] and not accelerator._models


def test_accumulation_steps_can_change_and_optimizer_wrapper_forwards():
    accelerator = nbaccel.Accelerator()
    accelerator.gradient_accumulation_steps = 3
    assert accelerator.gradient_accumulation_steps == 3 and accelerator.gradient_state.num_steps == 3
    _, optimizer = model_and_optimizer()
    wrapped = accelerator.prepare(optimizer)
    wrapped.param_groups[0]["lr"] = 0.5
    assert optimizer.param_groups[0]["lr"] == 0.5 and wrapped.defaults["lr"] == 0.05
    wrapped.load_state_dict(wrapped.state_dict())
    assert "SGD" in repr(wrapped)


def _ddp_kwargs() -> bool:
    handler = nbaccel.DistributedDataParallelKwargs(find_unused_parameters=True)
    accelerator = nbaccel.Accelerator(kwargs_handlers=[handler])
    model = accelerator.prepare(TinyMLP())
    return model.find_unused_parameters


def test_ddp_kwargs_reach_the_ddp_wrapper():
    assert launch(_ddp_kwargs, 2) == {0: True, 1: True}


def test_seeding_and_rng_snapshots():
    nbaccel.set_seed(3)
    a = torch.rand(2)
    nbaccel.set_seed(3, device_specific=True)  # process 0: the same seed
    assert torch.equal(torch.rand(2), a)
    from nbaccel.training.random import capture_rng_state, restore_rng_state

    gen = torch.Generator().manual_seed(1)
    snap = capture_rng_state({"g": gen})
    x, g = torch.rand(1), torch.rand(1, generator=gen)
    restore_rng_state(snap, {"g": gen})
    assert torch.equal(torch.rand(1), x) and torch.equal(torch.rand(1, generator=gen), g)
    nbaccel.set_seed(0, deterministic=True)
    torch.use_deterministic_algorithms(False)
