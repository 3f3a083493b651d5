"""Which samples each process reads: batch-sampler and iterable-dataset shards, seedable and skipping samplers.

Batches are dealt the way Accelerate deals them. Without ``split_batches``, batch ``i`` of the
original loader goes to rank ``i % n``; with it, every batch is cut into ``n`` equal slices.
``even_batches`` pads the last round by cycling from the start, so every rank runs the same
number of steps (and collectives never wait on a rank that ran out).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, IterableDataset, RandomSampler, Sampler

from nbaccel.errors import ConfigError

__all__ = ["BatchSamplerShard", "IterableDatasetShard", "SeedableRandomSampler", "SkipBatchSampler"]


class SeedableRandomSampler(RandomSampler):
    """A ``RandomSampler`` whose order depends only on ``initial_seed + epoch`` (same on every rank).

    Built as Accelerate's: ``SeedableRandomSampler(data_source, generator=..., data_seed=...)``;
    the seed defaults to ``torch.initial_seed()`` (what ``set_seed`` set), and each full pass
    moves to the next epoch, so passes differ even without ``set_epoch``.

    Args:
        data_source: the dataset.
        replacement: draw with replacement.
        num_samples: samples per pass (default: the dataset's length).
        generator: the generator reseeded for each pass (a new one when ``None``).
        data_seed: the seed of epoch 0.
        initial_seed: nbaccel's earlier name for ``data_seed``.

    Example:
        >>> s = SeedableRandomSampler(range(4), data_seed=1)
        >>> first = list(s); list(s) != first, (s.set_epoch(0), list(s))[1] == first
        (True, True)
    """

    def __init__(self, data_source: Any, replacement: bool = False, num_samples: int | None = None,
                 generator: torch.Generator | None = None, data_seed: int | None = None,
                 initial_seed: int | None = None) -> None:
        super().__init__(data_source, replacement=replacement, num_samples=num_samples,
                         generator=generator if generator is not None else torch.Generator())
        seed = data_seed if data_seed is not None else initial_seed
        self.initial_seed = seed if seed is not None else torch.initial_seed()
        self.epoch = 0

    def __iter__(self) -> Iterator[int]:
        assert self.generator is not None
        self.generator.manual_seed(self.initial_seed + self.epoch)
        yield from super().__iter__()
        self.set_epoch(self.epoch + 1)

    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch``."""
        self.epoch = epoch


class BatchSamplerShard(BatchSampler):
    """The part of ``batch_sampler``'s batches that belongs to ``process_index``.

    Args:
        batch_sampler: the original batch sampler (its ``batch_size`` and ``drop_last`` are used).
        num_processes: how many processes share the batches.
        process_index: this process's rank.
        split_batches: cut each batch into ``num_processes`` slices instead of dealing whole batches.
        even_batches: pad the last round from the start so every rank gets as many full batches.

    Raises:
        ConfigError: ``split_batches`` with a batch size not divisible by ``num_processes``.

    Example:
        >>> base = BatchSampler(range(10), batch_size=2, drop_last=False)
        >>> list(BatchSamplerShard(base, num_processes=2, process_index=1))
        [[2, 3], [6, 7], [0, 1]]
    """

    def __init__(self, batch_sampler: Iterable[list[int]], num_processes: int = 1, process_index: int = 0,
                 split_batches: bool = False, even_batches: bool = True) -> None:
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        size = getattr(batch_sampler, "batch_size", None)  # BatchSampler's __init__ is not run (as in Accelerate)
        self.batch_size: int | None = size  # type: ignore[assignment]  # None: the wrapped sampler has no batch size
        self.drop_last: bool = getattr(batch_sampler, "drop_last", False)
        if split_batches and self.batch_size is not None and self.batch_size % num_processes != 0:
            raise ConfigError(
                f"To use `BatchSamplerShard` in `split_batches` mode, the batch size ({self.batch_size}) needs to be a "
                f"round multiple of the number of processes ({num_processes}). Fix: use batch_size="
                f"{self.batch_size - self.batch_size % num_processes or num_processes}.",
                key="batch_size", value=self.batch_size, valid=f"a multiple of {num_processes}")

    @property
    def sampler(self) -> Any:  # type: ignore[override]  # read-only: the wrapped batch sampler's, looked up live
        """The original batch sampler's sampler."""
        return getattr(self.batch_sampler, "sampler", None)

    @property
    def total_length(self) -> int:
        return len(self.batch_sampler)  # type: ignore[arg-type]  # a sized sampler here

    def __len__(self) -> int:
        total = len(self.batch_sampler)  # type: ignore[arg-type]  # a sized sampler here
        if self.split_batches:
            return total
        full, rest = divmod(total, self.num_processes)
        if rest == 0 or self.drop_last:
            return full
        if self.even_batches:
            return full + 1
        return full + 1 if self.process_index < rest else full

    def __iter__(self) -> Iterator[list[int]]:
        return self._iter_split() if self.split_batches else self._iter_dealt()

    def _iter_split(self) -> Iterator[list[int]]:
        n, rank = self.num_processes, self.process_index
        first: list[int] = []
        batch: list[int] = []
        for idx, batch in enumerate(self.batch_sampler):
            if idx == 0:
                first = list(batch)
            size = len(batch) // n if self.batch_size is None else self.batch_size // n
            if self.batch_size is None or len(batch) == self.batch_size:
                yield batch[size * rank: size * (rank + 1)]
                batch = []
        if not batch or self.drop_last or self.batch_size is None:
            return
        size = self.batch_size // n
        if not self.even_batches:
            if len(batch) > size * rank:
                yield batch[size * rank: size * (rank + 1)]
            return
        while len(first) < self.batch_size:
            first += first
        padded = list(batch) + first
        yield padded[size * rank: size * (rank + 1)]

    def _iter_dealt(self) -> Iterator[list[int]]:
        n, rank, bs = self.num_processes, self.process_index, self.batch_size
        start: list[int] = []  # the first round's indices, to cycle from at the end
        first_batches: list[list[int]] = []  # the same as whole batches, for batches of varying size
        mine: list[int] = []
        batch: list[int] = []
        idx = -1
        for idx, batch in enumerate(self.batch_sampler):
            if not self.drop_last and idx < n:
                start += batch
                first_batches.append(list(batch))
            if idx % n == rank:
                mine = batch
            if idx % n == n - 1 and (bs is None or len(batch) == bs):
                yield mine
                mine = []
        if self.drop_last or not start:
            return
        if not self.even_batches:
            if mine:
                yield mine
            return
        if bs is None:  # varying sizes: pad the last round with whole batches from the first, as Accelerate does
            if mine:
                yield mine
            while len(first_batches) < n:
                first_batches += first_batches
            for cursor, later in enumerate(range(idx + 1, -(-(idx + 1) // n) * n)):
                if later % n == rank:
                    yield first_batches[cursor]
            return
        if len(mine) == bs:
            yield mine
        while len(start) < n * bs:
            start += start
        if len(batch) == bs:
            batch, idx = [], idx + 1
        cursor = 0
        while idx % n != 0 or batch:
            end = cursor + bs - len(batch)
            batch = list(batch) + start[cursor:end]
            if idx % n == rank:
                yield batch
            cursor, batch, idx = end, [], idx + 1


class IterableDatasetShard(IterableDataset):
    """The part of an iterable dataset that belongs to ``process_index``.

    Every process iterates the whole dataset and keeps its slice of each chunk of
    ``batch_size * num_processes`` samples (``batch_size`` when ``split_batches``). The last
    chunk is padded from the first one unless ``drop_last``.

    Example:
        >>> list(IterableDatasetShard(range(6), batch_size=2, num_processes=2, process_index=1))
        [2, 3, 0, 1]
    """

    def __init__(self, dataset: Iterable[Any], batch_size: int = 1, drop_last: bool = False, num_processes: int = 1,
                 process_index: int = 0, split_batches: bool = False) -> None:
        if split_batches and batch_size > 1 and batch_size % num_processes != 0:
            raise ConfigError(
                f"To use `IterableDatasetShard` in `split_batches` mode, the batch size ({batch_size}) needs to be a "
                f"round multiple of the number of processes ({num_processes}). Fix: use batch_size="
                f"{batch_size - batch_size % num_processes or num_processes}.", key="batch_size", value=batch_size,
                valid=f"a multiple of {num_processes}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.epoch = 0
        self.samples_seen = 0

    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch to the wrapped dataset when it takes one."""
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        total = len(self.dataset)  # type: ignore[arg-type]  # a sized dataset here
        chunk = self.batch_size if self.split_batches else self.batch_size * self.num_processes
        per = chunk // self.num_processes
        rounds = total // chunk if self.drop_last else -(-total // chunk)
        return rounds * per

    def __iter__(self) -> Iterator[Any]:
        chunk_size = self.batch_size if self.split_batches else self.batch_size * self.num_processes
        per = chunk_size // self.num_processes
        lo, hi = per * self.process_index, per * (self.process_index + 1)
        first: list[Any] = []
        chunk: list[Any] = []
        self.samples_seen = 0
        for item in self.dataset:
            self.samples_seen += 1
            chunk.append(item)
            if len(chunk) == chunk_size:
                yield from chunk[lo:hi]
                if not first:
                    first = chunk
                chunk = []
        if chunk and not self.drop_last:
            if not first:
                first = list(chunk)
            while len(chunk) < chunk_size:
                chunk += first
            yield from chunk[lo:hi]


class SkipBatchSampler(Sampler[list[int]]):
    """A batch sampler that drops the first ``skip_batches`` batches of another (no data is loaded for them).

    Example:
        >>> list(SkipBatchSampler([[0], [1], [2]], skip_batches=2))
        [[2]]
    """

    def __init__(self, batch_sampler: Iterable[list[int]], skip_batches: int = 0) -> None:
        self.batch_sampler = batch_sampler
        self.skip_batches = skip_batches

    @property
    def sampler(self) -> Any:
        return getattr(self.batch_sampler, "sampler", None)

    @property
    def batch_size(self) -> int | None:
        return getattr(self.batch_sampler, "batch_size", None)

    def __iter__(self) -> Iterator[list[int]]:
        for index, batch in enumerate(self.batch_sampler):
            if index >= self.skip_batches:
                yield batch

    def __len__(self) -> int:
        return max(len(self.batch_sampler) - self.skip_batches, 0)  # type: ignore[arg-type]  # a sized sampler here
