"""Prepared dataloaders: sharded across processes, moved to the device, aware of their last batch.

:func:`prepare_data_loader` rebuilds a ``DataLoader`` around a
:class:`~nbaccel.data_sharding.BatchSamplerShard` (map-style datasets) or an
:class:`~nbaccel.data_sharding.IterableDatasetShard` (iterable ones), or, with
``dispatch_batches``, lets rank 0 read every batch and send each rank its slice. Iteration
looks one batch ahead so the :class:`~nbaccel.gradient_state.GradientState` knows the last
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
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from nbaccel.data_sharding import BatchSamplerShard, IterableDatasetShard, SeedableRandomSampler, SkipBatchSampler
from nbaccel.gradient_state import GradientState
from nbaccel.ops import broadcast, broadcast_object_list, concatenate, find_batch_size, send_to_device, slice_tensors
from nbaccel.plugins import DataLoaderConfiguration

__all__ = ["DataLoaderDispatcher", "DataLoaderShard", "prepare_data_loader", "skip_first_batches"]

_END = object()
# DataLoader arguments carried over when a loader is rebuilt.
_LOADER_KWARGS = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
                  "generator", "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order")


class DataLoaderShard(DataLoader):
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
    """

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
        self.iteration = 0
        self._epoch_owner: DataLoaderShard = self
        self._in_progress = False
        self._start_generator_state: torch.Tensor | None = None
        self._start_rng_state: torch.Tensor | None = None
        self._replay_rng_state: torch.Tensor | None = None

    # ------------------------------------------------------------------ epochs and state
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
        for target in {id(o): o for o in (sampler, inner, self.dataset) if o is not None}.values():
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
        _draw_seed(draws)
        if self.reseeded_sampler is not None:
            self.reseeded_sampler.generator = torch.Generator().manual_seed(_draw_seed(draws))
        if replay is None:
            torch.set_rng_state(draws.get_state())

    # ------------------------------------------------------------------ iteration
    def _begin(self) -> None:
        self.end_of_dataloader = False
        self.remainder = -1
        if self.total_batch_size and not self.source_drop_last:
            try:
                length = getattr(self.dataset, "total_dataset_length", None) or len(self.dataset)  # type: ignore[arg-type]
                self.remainder = length % self.total_batch_size
            except TypeError:  # an iterable dataset without a length
                pass
        self.gradient_state._add_dataloader(self)

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
        self._begin()

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

    def __iter__(self) -> Iterator[Any]:
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
    Without ``split_batches`` rank 0 reads ``num_processes`` batches per step.
    """

    def __init__(self, dataset: Any, *, num_processes: int, process_index: int, split_batches: bool,
                 even_batches: bool, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
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

    def __iter__(self) -> Iterator[Any]:
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


def _loader_kwargs(loader: DataLoader) -> dict[str, Any]:
    return {k: getattr(loader, k) for k in _LOADER_KWARGS if hasattr(loader, k) and k != "in_order"} | (
        {"in_order": loader.in_order} if hasattr(loader, "in_order") else {})


def _draw_seed(generator: torch.Generator | None = None) -> int:
    """One seed drawn the way torch's ``DataLoader`` and ``RandomSampler`` draw theirs."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def _shuffle_generator(sampler: Any, num_processes: int) -> torch.Generator | None:
    """The generator that decides a shuffling sampler's order, the same on every rank.

    ``None`` where the order needs none: a sampler that is not a ``RandomSampler``, a
    :class:`SeedableRandomSampler` (reseeded from its seed and epoch), or, in one process, a
    ``RandomSampler`` without a generator (it draws a seed from the global RNG each pass, as
    in Accelerate; the loader replays that draw after a resume).
    """
    if not isinstance(sampler, RandomSampler) or isinstance(sampler, SeedableRandomSampler):
        return None
    if sampler.generator is None:
        if num_processes == 1:
            return None
        seed = torch.tensor(_draw_seed(), dtype=torch.int64)
        sampler.generator = torch.Generator().manual_seed(int(broadcast(seed, from_process=0).item()))
    else:
        sampler.generator.set_state(broadcast(sampler.generator.get_state(), from_process=0))
    return sampler.generator


def _seedable(sampler: RandomSampler, config: DataLoaderConfiguration) -> SeedableRandomSampler:
    seed = config.data_seed
    if seed is None:  # the seed `set_seed` gave torch, as in Accelerate (rank 0's, should ranks differ)
        seed = broadcast_object_list([torch.initial_seed()], from_process=0)[0]
    return SeedableRandomSampler(sampler.data_source, replacement=sampler.replacement,
                                 num_samples=sampler._num_samples, initial_seed=seed)


def prepare_data_loader(dataloader: DataLoader, device: torch.device | None = None, num_processes: int = 1,
                        process_index: int = 0, config: DataLoaderConfiguration | None = None,
                        gradient_state: GradientState | None = None) -> DataLoaderShard:
    """Rebuild ``dataloader`` so this process reads its share of the batches, on ``device``.

    Args:
        dataloader: the original loader (left unchanged).
        device: where batches go (``None`` leaves them where the loader puts them).
        num_processes: processes sharing the data.
        process_index: this process's rank.
        config: splitting, padding, dispatching and seeding choices.
        gradient_state: the accelerator's state, told when the last batch comes.

    Returns:
        A :class:`DataLoaderShard` (or :class:`DataLoaderDispatcher`).

    Raises:
        ConfigError: ``split_batches`` with a batch size not divisible by ``num_processes``, or
            ``even_batches`` with a batch sampler that has no batch size.

    Example:
        >>> loader = prepare_data_loader(DataLoader(range(8), batch_size=2), num_processes=2, process_index=0)
        >>> [b.tolist() for b in loader]
        [[0, 1], [4, 5]]
    """
    config = config or DataLoaderConfiguration()
    dataset = dataloader.dataset
    iterable = isinstance(dataset, IterableDataset)
    dispatch = config.dispatch_batches if config.dispatch_batches is not None else (iterable and num_processes > 1)
    kwargs = _loader_kwargs(dataloader)
    if device is not None and device.type == "xla":
        device = None  # batches reach the device through MpDeviceLoader instead (see XlaDeviceLoader)
    common: dict[str, Any] = {"device": device, "gradient_state": gradient_state, "non_blocking": config.non_blocking}
    bs = dataloader.batch_size
    if dispatch and num_processes > 1:
        return _prepare_dispatcher(dataloader, num_processes, process_index, config, common | kwargs)
    if iterable:
        return _prepare_iterable(dataloader, num_processes, process_index, config, common | kwargs)
    sampler = dataloader.batch_sampler.sampler if hasattr(dataloader.batch_sampler, "sampler") else dataloader.sampler
    if isinstance(sampler, RandomSampler) and config.use_seedable_sampler:
        sampler = _seedable(sampler, config)
        batch_sampler: Any = BatchSampler(sampler, batch_size=bs, drop_last=dataloader.drop_last) if bs else None
    else:
        batch_sampler = dataloader.batch_sampler
    generator = _shuffle_generator(sampler, num_processes)
    reseeded = sampler if isinstance(sampler, RandomSampler) and generator is None and not isinstance(
        sampler, SeedableRandomSampler) else None
    if batch_sampler is None:
        batch_sampler = dataloader.batch_sampler
    if num_processes > 1:
        batch_sampler = BatchSamplerShard(batch_sampler, num_processes=num_processes, process_index=process_index,
                                          split_batches=config.split_batches, even_batches=config.even_batches)
    size = getattr(batch_sampler, "batch_size", None) or bs
    total = size if config.split_batches else (size * num_processes if size else None)
    return DataLoaderShard(dataset, batch_sampler=batch_sampler, total_batch_size=total, sync_generator=generator,
                           source_drop_last=dataloader.drop_last, draws_global_rng=dataloader.generator is None,
                           reseeded_sampler=reseeded, **common, **kwargs)


def _prepare_iterable(dataloader: DataLoader, num_processes: int, process_index: int,
                      config: DataLoaderConfiguration, kwargs: dict[str, Any]) -> DataLoaderShard:
    bs = dataloader.batch_size
    per = bs // num_processes if (config.split_batches and bs) else bs
    dataset: Any = dataloader.dataset
    if num_processes > 1:
        dataset = IterableDatasetShard(dataset, batch_size=bs or 1, drop_last=dataloader.drop_last,
                                       num_processes=num_processes, process_index=process_index,
                                       split_batches=config.split_batches)
    total = (bs if config.split_batches else bs * num_processes) if bs else None
    return DataLoaderShard(dataset, batch_size=per, drop_last=dataloader.drop_last, total_batch_size=total,
                           sync_generator=dataloader.generator, draws_global_rng=dataloader.generator is None,
                           **kwargs)


def _prepare_dispatcher(dataloader: DataLoader, num_processes: int, process_index: int,
                        config: DataLoaderConfiguration, kwargs: dict[str, Any]) -> DataLoaderDispatcher:
    bs = dataloader.batch_size
    if config.split_batches and bs and bs % num_processes:
        from nbaccel.errors import ConfigError

        raise ConfigError(f"with split_batches=True the batch size must be a multiple of num_processes="
                          f"{num_processes} (got batch_size={bs})", key="batch_size", value=bs,
                          valid=f"a multiple of {num_processes}")
    total = bs if config.split_batches else (bs * num_processes if bs else None)
    return DataLoaderDispatcher(dataloader.dataset, batch_size=bs, drop_last=dataloader.drop_last,
                                sampler=None if isinstance(dataloader.dataset, IterableDataset) else dataloader.sampler,
                                num_processes=num_processes, process_index=process_index,
                                split_batches=config.split_batches, even_batches=config.even_batches,
                                total_batch_size=total, **kwargs)


def skip_first_batches(dataloader: DataLoader, num_batches: int = 0) -> DataLoader:
    """A loader like ``dataloader`` that starts after its first ``num_batches`` batches.

    Used to resume mid-epoch: skipped batches are not loaded when the loader has a batch
    sampler. The epoch counter stays shared with ``dataloader``.

    Example:
        >>> loader = prepare_data_loader(DataLoader(range(6), batch_size=2))
        >>> [b.tolist() for b in skip_first_batches(loader, 2)]
        [[4, 5]]
    """
    if not isinstance(dataloader, DataLoaderShard):
        if getattr(dataloader, "batch_sampler", None) is not None and not isinstance(dataloader.dataset, IterableDataset):
            kw = _loader_kwargs(dataloader)
            return DataLoader(dataloader.dataset, batch_sampler=SkipBatchSampler(dataloader.batch_sampler, num_batches),
                              **kw)
        return DataLoaderShard(dataloader.dataset, batch_size=dataloader.batch_size, skip_batches=num_batches,
                               **_loader_kwargs(dataloader))
    common = {"device": dataloader.device, "gradient_state": dataloader.gradient_state,
              "non_blocking": dataloader.non_blocking, "total_batch_size": dataloader.total_batch_size,
              "sync_generator": dataloader.sync_generator, "source_drop_last": dataloader.source_drop_last,
              "draws_global_rng": dataloader.draws_global_rng, "reseeded_sampler": dataloader.reseeded_sampler}
    kwargs = _loader_kwargs(dataloader)
    if isinstance(dataloader, DataLoaderDispatcher) or isinstance(dataloader.dataset, IterableDataset):
        skipped: DataLoaderShard = _clone_with_skip(dataloader, num_batches)
    else:
        skipped = DataLoaderShard(dataloader.dataset, batch_sampler=SkipBatchSampler(dataloader.batch_sampler,
                                                                                     num_batches), **common, **kwargs)
    skipped._epoch_owner = dataloader._epoch_owner
    return skipped


def _clone_with_skip(dataloader: DataLoaderShard, num_batches: int) -> DataLoaderShard:
    """A copy of an iterable or dispatching loader that loads and drops its first batches."""
    import copy

    clone = copy.copy(dataloader)
    clone.__dict__["skip_batches"] = dataloader.skip_batches + num_batches
    return clone

