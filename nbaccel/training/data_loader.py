"""Prepared dataloaders: sharded across processes, moved to the device, aware of their last batch.

:func:`~nbaccel.training.loader_preparation.prepare_data_loader` rebuilds a ``DataLoader`` around a
:class:`~nbaccel.training.data_sharding.BatchSamplerShard` (map-style datasets) or an
:class:`~nbaccel.training.data_sharding.IterableDatasetShard` (iterable ones), or, with
``dispatch_batches``, lets rank 0 read every batch and send each rank its slice. Iteration
looks one batch ahead so the :class:`~nbaccel.training.gradient_state.GradientState` knows the last
batch while it is being processed (``gather_for_metrics`` and accumulation rely on that).
Shuffling draws what Accelerate draws: in one process a shuffling sampler takes its seed from
torch's global RNG each pass, as a plain ``DataLoader`` does; across processes it gets a generator
seeded once from rank 0's RNG, so every rank draws the same order. Each pass also takes the
workers' base seed from the global RNG. A pass records where the global RNG stood when it began,
so a checkpoint saved mid-pass replays the same order without drawing again.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler

from nbaccel.nested_data import (
    concatenate,
    find_batch_size,
    send_to_device,
    slice_tensors,
)
from nbaccel.ops import broadcast_object_list
from nbaccel.training.data_sharding import IterableDatasetShard
from nbaccel.training.gradient_state import GradientState
from nbaccel.training.loader_state import DataLoaderStateMixin
from nbaccel.training.skip_loader import BaseDataloader

__all__ = ["DataLoaderDispatcher", "DataLoaderShard", "draw_seed"]

_END = object()


class DataLoaderShard(DataLoader, DataLoaderStateMixin):
    """A ``DataLoader`` that yields this process's batches on ``device`` and flags the last one.

    Attributes:
        end_of_dataloader: ``True`` while the last batch of the pass is being processed.
        remainder: real samples in the last global batch (``-1`` when unknown).
        iteration: the epoch number, advanced after each full pass (see :meth:`set_epoch`).
        sync_generator: the generator that decides the shuffling order, the same on every rank
            (``None`` when the order comes from the global RNG or from a seed and the epoch).
        draws_global_rng: each pass draws the workers' base seed from torch's global RNG (the
            original loader had no ``generator``), as a plain ``DataLoader`` does.
        reseeded_sampler: a ``RandomSampler`` without a generator (one process): each pass
            seeds it with a second draw from the global RNG, as it would seed itself.
        base_dataloader: the loader itself (Accelerate's loaders wrap one; nbaccel's are one).
    """

    base_dataloader = BaseDataloader()

    def __init__(self, dataset: Any, device: torch.device | None = None, *, gradient_state: GradientState | None = None,
                 non_blocking: bool = False, total_batch_size: int | None = None, skip_batches: int = 0,
                 sync_generator: torch.Generator | None = None, source_drop_last: bool = False,
                 draws_global_rng: bool = False, reseeded_sampler: RandomSampler | None = None, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self.source_drop_last = source_drop_last or bool(kwargs.get("drop_last", False))
        self.device = device
        self.gradient_state = gradient_state or GradientState()
        self.non_blocking = non_blocking
        self.total_batch_size = total_batch_size
        self.skip_batches = skip_batches
        self.sync_generator = sync_generator
        self.draws_global_rng = draws_global_rng
        self.reseeded_sampler = reseeded_sampler
        self.end_of_dataloader = False
        self.remainder = -1
        # the loader whose epoch count this one shares (a skip_first_batches copy shares its
        # source's); None for itself, since a reference to self would be a cycle that keeps the
        # loader alive after `del loader` until the cyclic garbage collector runs
        self._shared_epoch_owner: DataLoaderShard | None = None
        self._iteration = 0
        self._in_progress = False
        self._start_generator_state: torch.Tensor | None = None
        self._start_rng_state: torch.Tensor | None = None
        self._replay_rng_state: torch.Tensor | None = None

    # ------------------------------------------------------------------ epochs and state
    @property
    def _epoch_owner(self) -> DataLoaderShard:
        return self if self._shared_epoch_owner is None else self._shared_epoch_owner

    @_epoch_owner.setter
    def _epoch_owner(self, owner: DataLoaderShard) -> None:
        self._shared_epoch_owner = None if owner is self else owner

    @property
    def iteration(self) -> int:
        """The epoch number; a loader from :func:`skip_first_batches` shares its source's (the same count)."""
        return self._epoch_owner._iteration

    @iteration.setter
    def iteration(self, value: int) -> None:
        self._epoch_owner._iteration = value

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s shuffling order (forwarded to samplers and datasets that take one).

        Example:
            >>> loader.set_epoch(3)   # doctest: +SKIP
        """
        self._epoch_owner.iteration = epoch
        self._apply_epoch(epoch)

    def _apply_epoch(self, epoch: int) -> None:
        sampler = getattr(self.batch_sampler, "sampler", None)
        inner = getattr(sampler, "sampler", sampler)  # SkipBatchSampler -> BatchSamplerShard -> sampler
        batch_samplers: list[Any] = []  # the user's own batch sampler too, under nbaccel's wrappers
        b = self.batch_sampler
        while b is not None and len(batch_samplers) < 4:
            batch_samplers.append(b)
            b = getattr(b, "batch_sampler", None)
        for target in {id(o): o for o in (*batch_samplers, sampler, inner, self.dataset) if o is not None}.values():
            if hasattr(target, "set_epoch"):
                target.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Where the pass stands: the epoch, and the shuffling generator and global RNG at the start of the pass."""
        owner = self._epoch_owner
        gen = self.sync_generator
        start = owner._start_generator_state if owner._in_progress else None
        return {"iteration": owner.iteration, "in_progress": owner._in_progress,
                "generator_state": (start if start is not None else gen.get_state()) if gen is not None else None,
                "rng_state": owner._start_rng_state if owner._in_progress else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`: the next pass draws the order the saved pass drew."""
        self._epoch_owner.iteration = state["iteration"]
        if self.sync_generator is not None and state.get("generator_state") is not None:
            self.sync_generator.set_state(state["generator_state"])
        # A pass saved mid-way already took its draws from the global RNG (restored separately):
        # the resumed pass replays them from the recorded state instead of drawing again. Only
        # rank 0 saves this state; elsewhere it only decides worker seeds, not the order.
        self._epoch_owner._replay_rng_state = state.get("rng_state") if self.draws_global_rng else None

    def _seed_pass(self) -> None:
        """Take this pass's seeds from the global RNG as a plain ``DataLoader`` would, or replay a restored pass's.

        A plain loader draws the workers' base seed, then (a shuffling sampler without a
        generator) the sampler's seed: two draws from the global RNG per pass.
        """
        owner = self._epoch_owner
        owner._start_rng_state = None
        if not self.draws_global_rng:
            return
        replay, owner._replay_rng_state = owner._replay_rng_state, None
        start = replay if replay is not None else torch.get_rng_state()
        owner._start_rng_state = start
        self.generator = torch.Generator()
        self.generator.set_state(start)  # DataLoader.__iter__ draws the base seed from it
        draws = torch.Generator()
        draws.set_state(start)
        draw_seed(draws)
        if self.reseeded_sampler is not None:
            self.reseeded_sampler.generator = torch.Generator().manual_seed(draw_seed(draws))
        if replay is None:
            torch.set_rng_state(draws.get_state())

    # ------------------------------------------------------------------ iteration
    def begin(self) -> None:
        """Start a pass (:class:`DataLoaderStateMixin`),
        the remainder counted unless the source drops its last batch."""
        self._drop_last = self.source_drop_last
        super().begin()

    def _finish(self) -> None:
        if self.remainder == -1 and isinstance(self.dataset, IterableDatasetShard) and self.total_batch_size:
            self.remainder = self.dataset.samples_seen % self.total_batch_size

    def _place(self, batch: Any) -> Any:
        # Collated batches are CPU tensors already: skip the walk over the batch on CPU.
        if self.device is None or self.device.type == "cpu":
            return batch
        return send_to_device(batch, self.device, self.non_blocking)

    def _start_pass(self) -> None:
        """Before a pass: the epoch reaches the sampler and dataset, and where the pass starts is recorded."""
        owner = self._epoch_owner
        self._apply_epoch(owner.iteration)
        owner._start_generator_state = self.sync_generator.get_state() if self.sync_generator is not None else None
        self._seed_pass()
        owner._in_progress = True
        self.begin()

    def _end_pass(self) -> None:
        owner = self._epoch_owner
        owner.iteration += 1
        owner._in_progress = False

    def _batches(self) -> Iterator[tuple[Any, bool]]:
        """This pass's batches after the skipped ones, each with whether it is the last (one batch ahead).

        Only reads: the pass's bookkeeping (:meth:`_start_pass`, :meth:`_mark_last`,
        :meth:`_end_pass`) is the consumer's, so it stays right when a prefetching thread runs this
        ahead of the training loop (``MpDeviceLoader`` on XLA).
        """
        it = DataLoader.__iter__(self)
        current = next(it, _END)
        index = 0
        while current is not _END:
            upcoming = next(it, _END)
            if index >= self.skip_batches:
                yield current, upcoming is _END
            index += 1
            current = upcoming

    def _mark_last(self) -> None:
        """The batch about to be processed is the pass's last."""
        self._finish()
        self.end_of_dataloader = True

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # torch types it as a private iterator class
        self._start_pass()
        try:
            for batch, last in self._batches():
                if last:
                    self._mark_last()
                yield self._place(batch)
            self._end_pass()
        finally:
            self.gradient_state._remove_dataloader(self)

    def __len__(self) -> int:
        return max(super().__len__() - self.skip_batches, 0)


class DataLoaderDispatcher(DataLoaderShard):
    """Rank 0 reads each global batch and every rank keeps its slice (``dispatch_batches=True``).

    Useful when the data source can only be read once (a stream), or reading is expensive.
    Without ``split_batches`` rank 0 reads ``num_processes`` batches per step. Built by hand as
    in Accelerate (``DataLoaderDispatcher(dataset, batch_size=...)``), it takes the job's
    process count and rank.
    """

    def __init__(self, dataset: Any, *, num_processes: int | None = None, process_index: int | None = None,
                 split_batches: bool = False, even_batches: bool = True, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        if num_processes is None or process_index is None:
            from nbaccel.process_state import ProcessState

            state = ProcessState()
            num_processes = state.num_processes if num_processes is None else num_processes
            process_index = state.process_index if process_index is None else process_index
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches

    def _fetch(self, it: Iterator[Any]) -> Any:
        """Rank 0: the next global batch (``_END`` when none is left); other ranks: ``None``."""
        if self.process_index != 0:
            return None
        if self.split_batches:
            return next(it, _END)
        parts = [b for b in (next(it, _END) for _ in range(self.num_processes)) if b is not _END]
        return concatenate(parts) if parts else _END

    def _seed_pass(self) -> None:
        """Rank 0 reads every batch through its own sampler: nothing to seed per pass here."""

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # torch types it as a private iterator class
        self._start_pass()  # rank 0 reads: its sampler and dataset must see the epoch
        first: Any = None
        try:
            it = DataLoader.__iter__(self) if self.process_index == 0 else iter(())
            current = self._fetch(it)
            index = 0
            while True:
                upcoming = self._fetch(it)
                flags = [current is _END, upcoming is _END, None if current is _END else current]
                broadcast_object_list(flags, from_process=0)  # ships rank 0's batch to all (CPU tensors)
                if flags[0]:
                    break
                batch = flags[2]
                first = batch if first is None else first
                if flags[1]:
                    self.end_of_dataloader = True
                    if self.remainder == -1 and self.total_batch_size:
                        self.remainder = (find_batch_size(batch) or 0) % self.total_batch_size
                if index >= self.skip_batches:
                    yield self._place(self._slice(batch, first))
                index += 1
                current = upcoming
            self._end_pass()
        finally:
            self.gradient_state._remove_dataloader(self)

    def _slice(self, batch: Any, first: Any) -> Any:
        size = find_batch_size(batch) or 0
        per = -(-size // self.num_processes)
        if self.even_batches and self.total_batch_size and size < self.total_batch_size:
            while (find_batch_size(batch) or 0) < self.total_batch_size:
                batch = concatenate([batch, first])
            batch = slice_tensors(batch, slice(0, self.total_batch_size))
            per = self.total_batch_size // self.num_processes
        return slice_tensors(batch, slice(per * self.process_index, per * (self.process_index + 1)))

    def __len__(self) -> int:
        whole = DataLoader.__len__(self)
        steps = whole if self.split_batches else -(-whole // self.num_processes)
        return max(steps - self.skip_batches, 0)


def draw_seed(generator: torch.Generator | None = None) -> int:
    """One seed drawn the way torch's ``DataLoader`` and ``RandomSampler`` draw theirs."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
