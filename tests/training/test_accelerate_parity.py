"""The same Accelerate-style script gives the same numbers with ``nbaccel`` as with ``accelerate``.

Skipped where Accelerate is not installed (it is a benchmark-only dependency).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from tests.training.helpers import launch, model_and_optimizer, regression_data

pytest.importorskip("accelerate")


def script(library: str, mixed_precision: str = "no") -> dict:
    """A typical Accelerate training + evaluation script; only the import differs."""
    lib = importlib.import_module(library)
    if library == "accelerate":  # its process-wide singletons survive fork; nbaccel's workers start fresh
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    accelerator = lib.Accelerator(gradient_accumulation_steps=2, cpu=True, mixed_precision=mixed_precision)
    model, optimizer = model_and_optimizer(momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.95)
    train = DataLoader(regression_data(96), batch_size=4)
    evaluate = DataLoader(regression_data(37, seed=1), batch_size=5)
    model, optimizer, train, evaluate, scheduler = accelerator.prepare(model, optimizer, train, evaluate, scheduler)
    losses = []
    for x, y in train:
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    preds = []
    with torch.no_grad():
        for x, _y in evaluate:
            preds.append(accelerator.gather_for_metrics(model(x)))
    return {"losses": losses, "lr": scheduler.get_last_lr(), "preds": torch.cat(preds),
            "n": accelerator.num_processes, "len": len(train)}


@pytest.mark.parametrize("num_processes", [1, 2])
def test_nbaccel_matches_accelerate_on_the_same_script(num_processes):
    if num_processes == 1:
        ours, theirs = script("nbaccel"), script("accelerate")
    else:
        ours, theirs = launch(script, 2, "nbaccel")[0], launch(script, 2, "accelerate")[0]
    assert ours["n"] == theirs["n"] == num_processes and ours["len"] == theirs["len"]
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), atol=1e-6, rtol=1e-6)
    assert ours["lr"] == pytest.approx(theirs["lr"])
    assert ours["preds"].shape == theirs["preds"].shape == (37, 1)
    torch.testing.assert_close(ours["preds"], theirs["preds"], atol=1e-6, rtol=1e-6)


def test_nbaccel_matches_accelerate_in_bf16():
    ours, theirs = script("nbaccel", "bf16"), script("accelerate", "bf16")
    assert ours["losses"] == theirs["losses"]
    assert torch.equal(ours["preds"], theirs["preds"]) and ours["preds"].dtype == torch.float32


def shuffled_batches(library: str, use_seedable_sampler: bool) -> dict:
    """Two epochs of a shuffled loader after ``set_seed(0)``, and the global RNG's next draw after them."""
    lib = importlib.import_module(library)
    if library == "accelerate":
        from accelerate.state import AcceleratorState, GradientState
        from accelerate.utils import set_seed

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    else:
        set_seed = lib.set_seed
    config = lib.DataLoaderConfiguration(use_seedable_sampler=use_seedable_sampler)
    accelerator = lib.Accelerator(cpu=True, dataloader_config=config)
    set_seed(0)
    loader = accelerator.prepare(DataLoader(torch.arange(22), batch_size=3, shuffle=True))
    epochs = [[b.tolist() for b in loader] for _ in range(2)]
    return {"epochs": epochs, "next_draw": torch.rand(4)}


@pytest.mark.parametrize("use_seedable_sampler", [False, True])
@pytest.mark.parametrize("num_processes", [1, 2])
def test_a_shuffled_loader_yields_accelerates_batches(num_processes, use_seedable_sampler):
    if num_processes == 1:
        ours = {0: shuffled_batches("nbaccel", use_seedable_sampler)}
        theirs = {0: shuffled_batches("accelerate", use_seedable_sampler)}
    else:
        ours = launch(shuffled_batches, 2, "nbaccel", use_seedable_sampler)
        theirs = launch(shuffled_batches, 2, "accelerate", use_seedable_sampler)
    for rank in range(num_processes):
        first, second = ours[rank]["epochs"]
        assert first != second  # a new order each epoch
        assert ours[rank]["epochs"] == theirs[rank]["epochs"]
        # the loader took as many draws from the global RNG as Accelerate's (dropout masks agree after it)
        assert torch.equal(ours[rank]["next_draw"], theirs[rank]["next_draw"])
