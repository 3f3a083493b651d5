"""fp16 clipping with gradient accumulation, through a real GradScaler on CPU, against an fp32 run.

The scaler unscales gradients once per optimizer step. Clipping on a micro-step that does not
sync used to unscale there and skip the unscale at the real step, so the next backward added
scaled gradients to unscaled ones (weights off by ~150 here, silently).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import nbaccel
from nbaccel.errors import EnvironmentStateError
from nbaccel.training.kwargs_handlers import GradScalerKwargs


def _train(mixed_precision: str, clip_every_micro_step: bool) -> torch.Tensor:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    accelerator = nbaccel.Accelerator(mixed_precision=mixed_precision, gradient_accumulation_steps=2,
                                      kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)])
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=4))
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            if clip_every_micro_step or accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_fp16_clipping_when_gradients_sync_matches_fp32():
    fp16 = _train("fp16", clip_every_micro_step=False)
    fp32 = _train("no", clip_every_micro_step=False)
    assert (fp16 - fp32).abs().max().item() < 1e-3


def test_fp16_clipping_on_a_micro_step_that_does_not_sync_is_refused():
    with pytest.raises(EnvironmentStateError) as info:
        _train("fp16", clip_every_micro_step=True)
    assert "sync_gradients=False" in str(info.value) and "if accelerator.sync_gradients" in str(info.value)


def test_bf16_and_fp32_may_clip_partial_sums_as_in_accelerate():
    assert torch.isfinite(_train("no", clip_every_micro_step=True)).all()
