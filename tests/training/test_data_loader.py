"""How prepared dataloaders deal batches to processes, pad, split, dispatch, skip and shuffle."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

import nbaccel
from nbaccel.training.loader_preparation import prepare_data_loader, skip_first_batches
from tests.training.helpers import (
    CountingStream,
    EpochRecordingDataset,
    EpochRecordingSampler,
    EpochShuffledStream,
    launch,
)


def _shards(n_items: int, batch_size: int, n: int, **kwargs) -> list[list[list[int]]]:
    base = BatchSampler(SequentialSampler(range(n_items)), batch_size=batch_size,
                        drop_last=kwargs.pop("drop_last", False))
    return [list(nbaccel.BatchSamplerShard(base, n, rank, **kwargs)) for rank in range(n)]


def test_batches_are_dealt_round_robin_and_padded_from_the_start():
    r0, r1 = _shards(10, 2, 2)
    assert r0 == [[0, 1], [4, 5], [8, 9]]
    assert r1 == [[2, 3], [6, 7], [0, 1]]  # padded by cycling from the start
    assert _shards(11, 2, 2)[1] == [[2, 3], [6, 7], [10, 0]]


def test_without_even_batches_the_last_rank_gets_fewer():
    r0, r1 = _shards(10, 2, 2, even_batches=False)
    assert r0 == [[0, 1], [4, 5], [8, 9]] and r1 == [[2, 3], [6, 7]]
    base = BatchSampler(SequentialSampler(range(10)), batch_size=2, drop_last=False)
    assert [len(nbaccel.BatchSamplerShard(base, 2, r, even_batches=False)) for r in (0, 1)] == [3, 2]


def test_drop_last_drops_the_incomplete_round():
    r0, r1 = _shards(11, 2, 2, drop_last=True)
    assert r0 == [[0, 1], [4, 5]] and r1 == [[2, 3], [6, 7]]


def test_split_batches_cuts_each_batch():
    r0, r1 = _shards(10, 4, 2, split_batches=True)
    assert r0 == [[0, 1], [4, 5], [8, 9]] and r1 == [[2, 3], [6, 7], [0, 1]]
    r0, r1 = _shards(10, 4, 2, split_batches=True, even_batches=False)
    assert r0[-1] == [8, 9] and len(r1) == 2


def test_tiny_datasets_cycle_until_every_rank_has_a_batch():
    shards = _shards(3, 2, 3)
    assert shards == [[[0, 1]], [[2, 0]], [[1, 2]]]
    assert all(len(s) == 1 for s in shards)


def test_sharding_errors():
    base = BatchSampler(SequentialSampler(range(10)), batch_size=3, drop_last=False)
    with pytest.raises(nbaccel.ConfigError) as info:
        nbaccel.BatchSamplerShard(base, 2, 0, split_batches=True)
    assert info.value.key == "batch_size"
    # batches of varying size (no batch_size): the last round is padded with whole first batches
    assert [list(nbaccel.BatchSamplerShard([[0, 1], [2], [3, 4, 5]], 2, r)) for r in (0, 1)] == \
        [[[0, 1], [3, 4, 5]], [[2], [0, 1]]]
    with pytest.raises(nbaccel.ConfigError):
        nbaccel.IterableDatasetShard(range(10), batch_size=3, num_processes=2, split_batches=True)
    with pytest.raises(nbaccel.ConfigError):
        prepare_data_loader(DataLoader(CountingStream(8), batch_size=3), num_processes=2, process_index=0,
                            config=nbaccel.DataLoaderConfiguration(split_batches=True, dispatch_batches=True))
    with pytest.raises(nbaccel.ConfigError, match="StatefulDataLoader"):
        nbaccel.DataLoaderConfiguration(use_stateful_dataloader=True)


def test_iterable_dataset_shard():
    assert list(nbaccel.IterableDatasetShard(range(6), batch_size=2, num_processes=2, process_index=1)) == [2, 3, 0, 1]
    shard = nbaccel.IterableDatasetShard(range(7), batch_size=2, num_processes=2, process_index=0, drop_last=True)
    assert list(shard) == [0, 1] and len(shard) == 2
    assert len(nbaccel.IterableDatasetShard(range(7), batch_size=2, num_processes=2)) == 4


def test_prepared_loader_flags_its_last_batch_and_remainder():
    loader = prepare_data_loader(DataLoader(range(10), batch_size=4), num_processes=2, process_index=0)
    flags = [(loader.end_of_dataloader, loader.remainder) for _ in loader]
    assert flags == [(False, 2), (True, 2)]
    assert loader.gradient_state.active_dataloader is None  # left the state after the pass


def test_skip_first_batches_and_epochs():
    loader = prepare_data_loader(DataLoader(range(8), batch_size=2, shuffle=True))
    it = iter(loader)
    [next(it) for _ in range(2)]
    state = loader.state_dict()  # mid-pass: the order's generator state at the start of the pass
    rest = [b.tolist() for b in it]
    assert loader.iteration == 1 and state["in_progress"] and state["iteration"] == 0
    loader.load_state_dict(state)
    skipped = skip_first_batches(loader, 2)
    assert [b.tolist() for b in skipped] == rest and len(skipped) == 2
    assert loader.iteration == 1  # the skipping loader advanced the shared epoch counter
    plain = skip_first_batches(DataLoader(range(6), batch_size=2), 1)
    assert [b.tolist() for b in plain] == [[2, 3], [4, 5]]
    stream = skip_first_batches(DataLoader(CountingStream(6), batch_size=2), 2)
    assert [b.reshape(-1).tolist() for b in stream] == [[4, 5]]
    stream_shard = skip_first_batches(prepare_data_loader(DataLoader(CountingStream(6), batch_size=2)), 1)
    assert len([b for b in stream_shard]) == 2


def test_skip_first_batches_keeps_a_sampler_of_batches_and_drop_last():
    """A loader whose sampler yields whole batches (``batch_size=None``) has no batch sampler: skipping kept
    neither it (prepared: iterated ``None``) nor, for a plain loader, the sampler; nor a stream's ``drop_last``."""
    def by_batches():
        return DataLoader(torch.arange(8), sampler=BatchSampler(SequentialSampler(range(8)), 2, False), batch_size=None)

    prepared = skip_first_batches(prepare_data_loader(by_batches()), 2)
    assert [b.tolist() for b in prepared] == [[4, 5], [6, 7]] and len(prepared) == 2
    assert [b.tolist() for b in skip_first_batches(by_batches(), 3)] == [[6, 7]]
    stream = skip_first_batches(DataLoader(CountingStream(5), batch_size=2, drop_last=True), 1)
    assert [b.reshape(-1).tolist() for b in stream] == [[2, 3]]


def test_seedable_sampler_orders_depend_on_seed_and_epoch():
    config = nbaccel.DataLoaderConfiguration(use_seedable_sampler=True, data_seed=7)
    a = prepare_data_loader(DataLoader(range(16), batch_size=4, shuffle=True), config=config)
    b = prepare_data_loader(DataLoader(range(16), batch_size=4, shuffle=True), config=config)
    epoch0 = [x.tolist() for x in a]
    epoch1 = [x.tolist() for x in a]
    assert epoch0 == [x.tolist() for x in b] and epoch0 != epoch1
    b.set_epoch(1)
    assert [x.tolist() for x in b] == epoch1
    unseeded = prepare_data_loader(DataLoader(range(16), batch_size=4, shuffle=True),
                                   config=nbaccel.DataLoaderConfiguration(use_seedable_sampler=True))
    assert sorted(v for x in unseeded for v in x.tolist()) == list(range(16))


def _read(kind: str) -> list:
    config = {"dispatch": nbaccel.DataLoaderConfiguration(dispatch_batches=True),
              "dispatch_split": nbaccel.DataLoaderConfiguration(dispatch_batches=True, split_batches=True),
              "stream_shard": nbaccel.DataLoaderConfiguration(dispatch_batches=False),
              "split": nbaccel.DataLoaderConfiguration(split_batches=True)}[kind]
    accelerator = nbaccel.Accelerator(dataloader_config=config)
    data = CountingStream(11) if kind.startswith("stream") else torch.arange(11)
    loader = accelerator.prepare(DataLoader(data, batch_size=4 if "split" in kind else 2))
    batches = [b.reshape(-1).tolist() for b in loader]
    seen = []
    for b in loader:
        seen += accelerator.gather_for_metrics(b.reshape(-1)).tolist()
    try:
        length = len(loader)
    except TypeError:  # a stream has no length
        length = len(batches)
    return [batches, seen, length]


@pytest.mark.parametrize("kind", ["dispatch", "dispatch_split", "stream_shard", "split"])
def test_every_reading_mode_gives_each_sample_once_to_gather_for_metrics(kind):
    results = launch(_read, 2, kind)
    assert results[0][1] == list(range(11)) and results[1][1] == list(range(11))
    assert results[0][2] == len(results[0][0]) == len(results[1][0])


def _dispatched_epochs() -> list:
    accelerator = nbaccel.Accelerator(dataloader_config=nbaccel.DataLoaderConfiguration(dispatch_batches=True))
    loader = accelerator.prepare(DataLoader(EpochShuffledStream(12), batch_size=2))
    epochs = [[x for b in loader for x in accelerator.gather(b.reshape(-1)).tolist()] for _ in range(2)]
    loader.set_epoch(0)
    return [*epochs, [x for b in loader for x in accelerator.gather(b.reshape(-1)).tolist()]]


def test_a_dispatched_loader_passes_the_epoch_to_its_dataset():
    first, second, replayed = launch(_dispatched_epochs, 2)[1]
    assert first == torch.randperm(12, generator=torch.Generator().manual_seed(0)).tolist()
    assert second == torch.randperm(12, generator=torch.Generator().manual_seed(1)).tolist()
    assert replayed == first


def _shuffled() -> list:
    accelerator = nbaccel.Accelerator()
    nbaccel.set_seed(accelerator.process_index)  # ranks seeded differently: the order still agrees
    loader = accelerator.prepare(DataLoader(torch.arange(16), batch_size=2, shuffle=True))
    return [accelerator.gather(b).tolist() for b in loader]


def test_shuffling_agrees_across_ranks_even_with_different_seeds():
    results = launch(_shuffled, 2)
    assert results[0] == results[1]
    assert sorted(v for batch in results[0] for v in batch) == list(range(16))


def _shuffled_batch_sampler() -> list:
    from torch.utils.data import RandomSampler

    accelerator = nbaccel.Accelerator()
    nbaccel.set_seed(accelerator.process_index)
    data = torch.arange(22)
    sampler = BatchSampler(RandomSampler(data), batch_size=4, drop_last=False)  # the dataset reads whole batches
    loader = accelerator.prepare(DataLoader(data, sampler=sampler, batch_size=None))
    return [v for b in loader for v in accelerator.gather_for_metrics(b).tolist()]


def test_a_shuffling_sampler_of_batches_agrees_across_ranks():
    """Accelerate's test_distributed_data_loop: ``sampler=BatchSampler(RandomSampler(...))`` sees each sample once."""
    results = launch(_shuffled_batch_sampler, 2)
    assert sorted(results[0]) == list(range(22)) and results[0] == results[1]


@pytest.mark.parametrize("num_processes", [1, 2])
def test_set_epoch_reaches_a_sampler_and_a_dataset_that_take_it(num_processes):
    sampler, dataset = EpochRecordingSampler(8), EpochRecordingDataset(8)
    loader = prepare_data_loader(DataLoader(dataset, batch_size=2, sampler=sampler), num_processes=num_processes,
                                 process_index=num_processes - 1)
    loader.set_epoch(3)
    assert sampler.epochs == [3] and dataset.epochs == [3]
    assert len([b for b in loader]) == 4 // num_processes  # the pass runs as epoch 3 ...
    assert sampler.epochs[-1] == dataset.epochs[-1] == 3 and loader.iteration == 4  # ... and the next is 4
    skipped = skip_first_batches(loader, 1)
    skipped.set_epoch(7)  # through the skipping loader too
    assert sampler.epochs[-1] == dataset.epochs[-1] == 7 and loader.iteration == 7


def test_batches_move_to_the_device():
    accelerator = nbaccel.Accelerator(dataloader_config=nbaccel.DataLoaderConfiguration(non_blocking=True))
    loader = accelerator.prepare(DataLoader([{"x": torch.ones(2)}] * 4, batch_size=2))
    assert all(batch["x"].device == accelerator.device for batch in loader)
    unplaced = accelerator.prepare_data_loader(DataLoader(torch.ones(4, 2), batch_size=2), device_placement=False)
    assert [b.shape for b in unplaced] == [torch.Size([2, 2])] * 2
