"""Accelerate's ``accelerate.data_loader`` import path: re-exports only, so its import lines port as is.

Nothing is defined here; the loaders live in :mod:`nbaccel.training.data_loader`, the samplers
and dataset shards in :mod:`nbaccel.training.data_sharding`, and ``prepare_data_loader`` /
``skip_first_batches`` in :mod:`nbaccel.training.loader_preparation`, ``SkipDataLoader`` in
:mod:`nbaccel.training.skip_loader`.
"""

from __future__ import annotations

from nbaccel.training.data_loader import DataLoaderDispatcher, DataLoaderShard
from nbaccel.training.data_sharding import (
    BatchSamplerShard,
    IterableDatasetShard,
    SeedableRandomSampler,
    SkipBatchSampler,
)
from nbaccel.training.loader_preparation import (
    get_sampler,
    prepare_data_loader,
    skip_first_batches,
)
from nbaccel.training.loader_state import DataLoaderStateMixin
from nbaccel.training.skip_loader import SkipDataLoader

__all__ = [
    "BatchSamplerShard",
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "DataLoaderStateMixin",
    "IterableDatasetShard",
    "SeedableRandomSampler",
    "SkipBatchSampler",
    "SkipDataLoader",
    "get_sampler",
    "prepare_data_loader",
    "skip_first_batches",
]
