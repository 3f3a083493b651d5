"""``prepare_data_loader`` called with Accelerate's arguments gives Accelerate's batches."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.utils.data import DataLoader

from nbaccel.errors import ConfigError

pytest.importorskip("accelerate")

CASES = [
    {"split_batches": True},
    {"even_batches": False},
    {"even_batches": True},
    {"split_batches": True, "even_batches": False},
    {"dispatch_batches": False, "non_blocking": True},
]


def batches(library: str, rank: int, options: dict) -> list:
    prepare = importlib.import_module(f"{library}.data_loader").prepare_data_loader
    loader = prepare(DataLoader(list(range(11)), batch_size=4), num_processes=2, process_index=rank,
                     device=torch.device("cpu"), put_on_device=True, **options)
    return [b.tolist() for b in loader]


@pytest.mark.parametrize("options", CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("rank", [0, 1])
def test_accelerates_arguments_give_accelerates_batches(options, rank):
    assert batches("nbaccel", rank, options) == batches("accelerate", rank, options)


def seeded(library: str) -> list:
    prepare = importlib.import_module(f"{library}.data_loader").prepare_data_loader
    loader = prepare(DataLoader(list(range(10)), batch_size=3, shuffle=True), num_processes=1, process_index=0,
                     use_seedable_sampler=True, data_seed=7)
    return [[b.tolist() for b in loader] for _ in range(2)]


def test_a_seeded_sampler_by_argument_matches():
    ours, theirs = seeded("nbaccel"), seeded("accelerate")
    assert ours == theirs and ours[0] != ours[1]


def test_options_given_twice_unknown_or_unsupported_are_refused():
    from nbaccel.data_loader import prepare_data_loader
    from nbaccel.utils import DataLoaderConfiguration

    loader = DataLoader(list(range(4)), batch_size=2)
    with pytest.raises(ConfigError, match="both") as info:
        prepare_data_loader(loader, config=DataLoaderConfiguration(), split_batches=True)
    assert info.value.key == "split_batches"
    with pytest.raises(ConfigError, match="unknown option") as info:
        prepare_data_loader(loader, split_batch=True)
    assert info.value.key == "split_batch" and "split_batches" in info.value.valid
    with pytest.raises(ConfigError, match="not supported") as info:
        prepare_data_loader(loader, slice_fn_for_dispatch=lambda *a: a)
    assert info.value.key == "slice_fn_for_dispatch"
    assert [b.tolist() for b in prepare_data_loader(loader, rng_types=None, torch_device_mesh=None)] == [[0, 1], [2, 3]]


def test_put_on_device_false_leaves_batches_where_the_loader_puts_them():
    from nbaccel.data_loader import prepare_data_loader

    loader = prepare_data_loader(DataLoader(list(range(4)), batch_size=2), device=torch.device("meta"),
                                 put_on_device=False)
    assert [b.device.type for b in loader] == ["cpu", "cpu"]
