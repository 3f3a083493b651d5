"""Loaders whose batches are not one fixed size are sharded as Accelerate shards them."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    Sampler,
    SequentialSampler,
)

pytest.importorskip("accelerate")


class Rows(Dataset):
    """A dataset that reads a whole batch of rows at once (``dataset[[3, 4, 5]]``)."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index):
        return torch.tensor(index)


class VaryingBatches(Sampler):
    def __iter__(self):
        yield from ([0], [1, 2], [3, 4, 5], [6], [7, 8])

    def __len__(self) -> int:
        return 5


def sharded(library: str, kind: str, rank: int, even_batches: bool) -> list:
    prepare = importlib.import_module(f"{library}.data_loader").prepare_data_loader
    if kind == "sampler of batches":
        loader = DataLoader(Rows(), sampler=BatchSampler(SequentialSampler(range(10)), 3, False), batch_size=None)
    else:
        loader = DataLoader(list(range(10)), batch_sampler=VaryingBatches())
    prepared = prepare(loader, num_processes=2, process_index=rank, even_batches=even_batches)
    return [b.tolist() for b in prepared]


@pytest.mark.parametrize("kind", ["sampler of batches", "varying batch sizes"])
@pytest.mark.parametrize("even_batches", [True, False])
@pytest.mark.parametrize("rank", [0, 1])
def test_batches_of_other_shapes_shard_as_in_accelerate(kind, even_batches, rank):
    ours = sharded("nbaccel", kind, rank, even_batches)
    assert ours == sharded("accelerate", kind, rank, even_batches)
    assert ours  # every rank got batches
