"""`prepare_data_loader` and `skip_first_batches`: a user's ``DataLoader`` rebuilt as this rank's loader.

The loaders themselves (look-ahead, device placement, dispatching) are :mod:`nbaccel.training.data_loader`;
this module decides how a given loader is sharded, shuffled and resumed.
"""

from __future__ import annotations

from typing import Any, overload

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from nbaccel.ops import broadcast, broadcast_object_list
from nbaccel.training.data_loader import (
    DataLoaderDispatcher,
    DataLoaderShard,
    draw_seed,
)
from nbaccel.training.data_sharding import (
    BatchSamplerShard,
    IterableDatasetShard,
    SeedableRandomSampler,
    SkipBatchSampler,
)
from nbaccel.training.gradient_state import GradientState
from nbaccel.training.loader_options import config_from_options
from nbaccel.training.plugins import DataLoaderConfiguration

__all__ = ["get_sampler", "prepare_data_loader", "skip_first_batches"]

# DataLoader arguments carried over when a loader is rebuilt.
_LOADER_KWARGS = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
                  "generator", "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order")


def _loader_kwargs(loader: DataLoader) -> dict[str, Any]:
    return {k: getattr(loader, k) for k in _LOADER_KWARGS if hasattr(loader, k) and k != "in_order"} | (
        {"in_order": loader.in_order} if hasattr(loader, "in_order") else {})


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
        seed = torch.tensor(draw_seed(), dtype=torch.int64)
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


def prepare_data_loader(dataloader: DataLoader, device: torch.device | None = None, num_processes: int | None = None,
                        process_index: int | None = None, config: DataLoaderConfiguration | None = None,
                        gradient_state: GradientState | None = None, *, put_on_device: bool | None = None,
                        **accelerate_options: Any) -> DataLoaderShard:
    """Rebuild ``dataloader`` so this process reads its share of the batches, on ``device``.

    Takes Accelerate's arguments too: ``split_batches``, ``even_batches``, ``dispatch_batches``,
    ``non_blocking``, ``use_seedable_sampler``, ``data_seed`` (the fields of
    :class:`DataLoaderConfiguration`, given one by one instead of ``config``), ``put_on_device``,
    and ``rng_types``, ``slice_fn_for_dispatch``, ``use_stateful_dataloader``,
    ``torch_device_mesh`` when left at their defaults.

    Args:
        dataloader: the original loader (left unchanged).
        device: where batches go (``None`` leaves them where the loader puts them).
        num_processes: processes sharing the data (default: this job's, as in Accelerate).
        process_index: this process's rank (default: this process's).
        config: splitting, padding, dispatching and seeding choices.
        gradient_state: the accelerator's state, told when the last batch comes.
        put_on_device: ``False`` leaves batches where the loader puts them even with a
            ``device``. Differs from Accelerate: ``None`` (the default) moves them when a
            ``device`` is given (Accelerate moves them only with ``put_on_device=True``).
        **accelerate_options: Accelerate's loader options, listed above.

    Returns:
        A :class:`DataLoaderShard` (or :class:`DataLoaderDispatcher`).

    Raises:
        ConfigError: ``split_batches`` with a batch size not divisible by ``num_processes``, or
            ``even_batches`` with a batch sampler that has no batch size; an option given both
            in ``config`` and by name; an unknown option, or one nbaccel does not support.

    Example:
        >>> loader = prepare_data_loader(DataLoader(range(8), batch_size=2), num_processes=2, process_index=0)
        >>> [b.tolist() for b in loader]
        [[0, 1], [4, 5]]
    """
    config = config_from_options(config, accelerate_options)
    if num_processes is None or process_index is None:
        from nbaccel.process_state import ProcessState

        state = ProcessState()
        num_processes = state.num_processes if num_processes is None else num_processes
        process_index = state.process_index if process_index is None else process_index
    if put_on_device is False:
        device = None
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
    if dataloader.batch_sampler is None and isinstance(dataloader.sampler, BatchSampler):
        return _prepare_sampler_of_batches(dataloader, num_processes, process_index, config, common | kwargs)
    sampler = getattr(dataloader.batch_sampler, "sampler", dataloader.sampler)
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


def _prepare_sampler_of_batches(dataloader: DataLoader, num_processes: int, process_index: int,
                                config: DataLoaderConfiguration, kwargs: dict[str, Any]) -> DataLoaderShard:
    """``DataLoader(ds, sampler=BatchSampler(...), batch_size=None)``: the dataset reads whole batches; shard those."""
    batches: Any = dataloader.sampler
    if num_processes > 1:
        batches = BatchSamplerShard(batches, num_processes=num_processes, process_index=process_index,
                                    split_batches=config.split_batches, even_batches=config.even_batches)
    size = getattr(batches, "batch_size", None)
    total = size if config.split_batches else (size * num_processes if size else None)
    # a shuffling sampler inside must draw the same order on every rank, or ranks overlap
    generator = _shuffle_generator(getattr(dataloader.sampler, "sampler", None), num_processes)
    return DataLoaderShard(dataloader.dataset, sampler=batches, batch_size=None, total_batch_size=total,
                           sync_generator=generator,
                           source_drop_last=getattr(dataloader.sampler, "drop_last", False), **kwargs)


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

        raise ConfigError(f"To use a `DataLoader` in `split_batches` mode, the batch size ({bs}) needs to be a round "
                          f"multiple of the number of processes ({num_processes}). Fix: use batch_size="
                          f"{bs - bs % num_processes or num_processes}.", key="batch_size", value=bs,
                          valid=f"a multiple of {num_processes}")
    total = bs if config.split_batches else (bs * num_processes if bs else None)
    return DataLoaderDispatcher(dataloader.dataset, batch_size=bs, drop_last=dataloader.drop_last,
                                sampler=None if isinstance(dataloader.dataset, IterableDataset) else dataloader.sampler,
                                num_processes=num_processes, process_index=process_index,
                                split_batches=config.split_batches, even_batches=config.even_batches,
                                total_batch_size=total, **kwargs)


@overload
def skip_first_batches(dataloader: DataLoaderShard, num_batches: int = 0) -> DataLoaderShard: ...
@overload
def skip_first_batches(dataloader: DataLoader, num_batches: int = 0) -> DataLoader: ...
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
        batch_sampler = getattr(dataloader, "batch_sampler", None)
        if batch_sampler is not None and not isinstance(dataloader.dataset, IterableDataset):
            kw = _loader_kwargs(dataloader)
            return DataLoader(dataloader.dataset, batch_sampler=SkipBatchSampler(batch_sampler, num_batches), **kw)
        # no batch sampler: a stream, or a sampler of whole batches (batch_size=None) that the copy keeps
        sampler = None if isinstance(dataloader.dataset, IterableDataset) else dataloader.sampler
        return DataLoaderShard(dataloader.dataset, batch_size=dataloader.batch_size, sampler=sampler,
                               drop_last=dataloader.drop_last, skip_batches=num_batches, **_loader_kwargs(dataloader))
    common: dict[str, Any] = {"device": dataloader.device, "gradient_state": dataloader.gradient_state,
              "non_blocking": dataloader.non_blocking, "total_batch_size": dataloader.total_batch_size,
              "sync_generator": dataloader.sync_generator, "source_drop_last": dataloader.source_drop_last,
              "draws_global_rng": dataloader.draws_global_rng, "reseeded_sampler": dataloader.reseeded_sampler}
    kwargs = _loader_kwargs(dataloader)
    batch_sampler = dataloader.batch_sampler
    # No batch sampler to skip in: a dispatcher, a stream, or a sampler of whole batches (batch_size=None).
    if (isinstance(dataloader, DataLoaderDispatcher) or isinstance(dataloader.dataset, IterableDataset)
            or batch_sampler is None):
        skipped: DataLoaderShard = _clone_with_skip(dataloader, num_batches)
    else:
        skipped = DataLoaderShard(dataloader.dataset, batch_sampler=SkipBatchSampler(batch_sampler, num_batches),
                                  **common, **kwargs)
    skipped._epoch_owner = dataloader._epoch_owner
    return skipped


def _clone_with_skip(dataloader: DataLoaderShard, num_batches: int) -> DataLoaderShard:
    """A copy of an iterable or dispatching loader that loads and drops its first batches."""
    import copy

    clone = copy.copy(dataloader)
    clone.__dict__["skip_batches"] = dataloader.skip_batches + num_batches
    return clone



def get_sampler(dataloader: DataLoader) -> Any:
    """The sampler of ``dataloader`` (the one inside its batch sampler, or inside a sampler of batches).

    Example:
        >>> type(get_sampler(DataLoader(range(4), batch_size=2, shuffle=True))).__name__
        'RandomSampler'
    """
    if isinstance(dataloader.sampler, BatchSampler):
        return getattr(dataloader.sampler, "sampler", None)
    return getattr(dataloader.batch_sampler, "sampler", None)
