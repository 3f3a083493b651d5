"""Samplers mean what they mean in Accelerate: a ``SeedableRandomSampler`` built by hand, and epochs reaching a batch
sampler."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

pytest.importorskip("accelerate")


def sampled(library: str) -> dict:
    Sampler = importlib.import_module(f"{library}.data_loader").SeedableRandomSampler
    torch.manual_seed(123)
    default = Sampler(list(range(8)))
    passes = [list(default), list(default)]
    generator = torch.Generator()
    built = Sampler(data_source=list(range(8)), generator=generator, data_seed=5)
    first = list(built)
    built.set_epoch(0)
    return {"seed": default.initial_seed, "passes": passes, "first": first, "again": list(built),
            "epoch": built.epoch, "same_generator": built.generator is generator}


def test_seedable_random_sampler_is_built_and_advances_as_in_accelerate():
    ours, theirs = sampled("nbaccel"), sampled("accelerate")
    assert ours == theirs
    assert ours["seed"] == 123 and ours["passes"][0] != ours["passes"][1]  # each pass moves to the next epoch
    assert ours["first"] == ours["again"] and ours["epoch"] == 1 and ours["same_generator"]


class EpochBatches(BatchSampler):
    """A batch sampler whose batches depend on the epoch it was told (rotated by the epoch)."""

    def __init__(self) -> None:
        super().__init__(SequentialSampler(range(8)), batch_size=2, drop_last=False)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        for batch in super().__iter__():
            yield [(i + self.epoch) % 8 for i in batch]


def epochs(library: str) -> list:
    lib = importlib.import_module(library)
    if library == "accelerate":
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    accelerator = lib.Accelerator(cpu=True)
    batch_sampler = EpochBatches()
    loader = accelerator.prepare(DataLoader(list(range(8)), batch_sampler=batch_sampler))
    loader.set_epoch(3)
    return [batch_sampler.epoch, [b.tolist() for b in loader]]


def test_set_epoch_reaches_a_batch_sampler():
    ours, theirs = epochs("nbaccel"), epochs("accelerate")
    assert ours == theirs
    assert ours[0] == 3 and ours[1][0] == [3, 4]
