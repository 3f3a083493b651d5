"""Budgets, module sizes and device maps, on a CPU-only machine (GPUs first, then CPU, then disk)."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch
from torch import nn

from nbaccel.big_modeling import (
    compute_module_sizes,
    find_tied_parameters,
    get_balanced_memory,
    get_max_memory,
    infer_auto_device_map,
)
from nbaccel.big_modeling.device_map import check_device_map, resolve_device_map
from nbaccel.big_modeling.map_devices import device_for
from nbaccel.big_modeling.sizes import convert_file_size_to_int, get_max_layer_size
from nbaccel.errors import ConfigError, DeviceMapError
from tests.big_modeling.helpers import TinyLM, empty_model

BLOCK = (16 * 2 + 32 * 16 + 32 + 16 * 32 + 16 + 16) * 4  # norm, up, down, gate: 4480 bytes


@pytest.mark.parametrize("text,expected", [("512MiB", 512 * 2**20), ("1GB", 10**9),
                                           ("1.5GiB", int(1.5 * 2**30)), ("100kb", 100 * 125),
                                           (7, 7), ("2 MB", 2 * 10**6)])
def test_sizes(text, expected):
    assert convert_file_size_to_int(text) == expected


@pytest.mark.parametrize("bad", ["lots", "12XB", "-5MB", "42", -1, 1.5, None, True])
def test_malformed_sizes(bad):
    with pytest.raises(ConfigError) as info:
        get_max_memory({"cpu": bad})
    assert info.value.key == "max_memory" and info.value.value == bad


@pytest.mark.parametrize("bad", [{0: "1GiB"}, {"cuda:1": 10}, {"gpu": "1GiB"}, {"cpu ": 1},
                                 {True: 1}])
def test_malformed_max_memory_keys(bad):
    with pytest.raises(ConfigError) as info:
        get_max_memory(bad)
    assert info.value.key == "max_memory"
    assert "'cpu', 'disk'" in str(info.value)


def test_max_memory_must_be_a_mapping():
    with pytest.raises(ConfigError) as info:
        get_max_memory("512MiB")
    assert info.value.value == "512MiB"


def test_max_memory_is_converted_and_ordered():
    assert list(get_max_memory({"disk": "1GB", "cpu": "1KiB"}).items()) == [("cpu", 1024),
                                                                              ("disk", 10**9)]
    measured = get_max_memory()
    assert list(measured) == ["cpu"] and measured["cpu"] > 2**20


def test_given_max_memory_never_initializes_cuda():
    code = ("import torch; from nbaccel.big_modeling import get_max_memory, "
            "infer_auto_device_map; get_max_memory({'cpu': '1GiB'}); "
            "infer_auto_device_map(torch.nn.Linear(2, 2), {'cpu': 100}); "
            "print(torch.cuda.is_initialized())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"


def test_module_sizes_count_tied_weights_once():
    sizes = compute_module_sizes(empty_model())
    assert sizes["embed"] == 32 * 16 * 4 and sizes["head"] == 0
    assert sizes["blocks.0"] == BLOCK
    assert sizes[""] == 32 * 16 * 4 + 64 * 4 + 4 * BLOCK + 32 * 4
    assert compute_module_sizes(empty_model(), dtype=torch.float16)["embed"] == 32 * 16 * 2
    assert compute_module_sizes(empty_model(), buffers_only=True)[""] == 64 * 4 + 4 * 16 * 4


def test_tied_parameters_are_found():
    assert find_tied_parameters(empty_model()) == [["embed.weight", "head.weight"]]


def test_max_layer_size_respects_no_split():
    model = empty_model()
    sizes = compute_module_sizes(model)
    pieces = list(model.named_children())
    assert get_max_layer_size(pieces, sizes, ["Block"])[0] == BLOCK
    assert get_max_layer_size(pieces, sizes, []) == ((32 * 16 + 32) * 4,
                                                     [f"blocks.{i}.up" for i in range(4)])


def test_balanced_memory_without_gpus_is_the_budget():
    assert get_balanced_memory(empty_model(), {"cpu": 1000}, low_zero=True) == {"cpu": 1000}


def test_auto_map_fills_cpu_keeps_blocks_whole_and_reserves_one():
    budget = 2048 + 3 * BLOCK
    device_map = infer_auto_device_map(empty_model(), {"cpu": budget},
                                       no_split_module_classes=["Block"], offload_buffers=True)
    # two blocks fit beside the embedding and its tied head; the third block's room is kept to
    # run offloaded ones (direct buffers come last, as in Accelerate)
    assert device_map == {"embed": "cpu", "positions": "disk", "blocks.0": "cpu",
                          "blocks.1": "cpu", "blocks.2": "disk", "blocks.3": "disk",
                          "norm": "disk", "head": "cpu"}
    assert check_device_map(empty_model(), device_map) == device_map


def test_buffers_left_on_the_execution_device_do_not_change_placement():
    budget = 2048 + 3 * BLOCK
    # without GPUs the offloaded blocks' buffers run on the CPU: no warning, the same map
    assert infer_auto_device_map(empty_model(), {"cpu": budget}, ["Block"]) == \
        infer_auto_device_map(empty_model(), {"cpu": budget}, ["Block"], offload_buffers=True)


def test_auto_map_puts_everything_on_cpu_when_it_fits():
    assert infer_auto_device_map(empty_model(), {"cpu": "1MiB"}) == {"": "cpu"}


def test_map_splits_modules_that_are_not_no_split():
    device_map = infer_auto_device_map(empty_model(), {"cpu": 2048 + 256 + BLOCK + 100})
    assert any(k.startswith("blocks.0.") or k.startswith("blocks.1.") for k in device_map)
    assert check_device_map(empty_model(), device_map)


def test_tied_alias_costs_nothing_beside_its_embedding():
    model = TinyLM(blocks=1)
    sizes = compute_module_sizes(model)
    device_map = infer_auto_device_map(model, {"cpu": sizes[""]})
    assert device_map == {"": "cpu"}


@pytest.mark.parametrize("dtype", [torch.float16, "float16"])
def test_a_tied_head_goes_with_its_embedding_sized_in_the_load_dtype(dtype):
    # fp16: the embedding (1024 B) and its tied head (nothing more) fill the first device once
    # one block's room (2240 B, the largest piece left) is kept free there
    device_map = infer_auto_device_map(empty_model(), {0: 1024 + 2240, "cpu": 10_500},
                                       ["Block"], dtype=dtype)
    assert device_map == {"embed": 0, "blocks": "cpu", "norm": "cpu", "head": 0,
                          "positions": "cpu"}
    # a byte less and nothing fits on GPU 0
    assert infer_auto_device_map(empty_model(), {0: 1024 + 2239, "cpu": 10_500}, ["Block"],
                                 dtype=dtype) == {"": "cpu"}


@pytest.mark.parametrize("strategy", ["auto", "balanced", "balanced_low_0", "sequential"])
def test_every_strategy_works_without_gpus(strategy):
    device_map = resolve_device_map(empty_model(), strategy, {"cpu": 2048 + 256 + 2 * BLOCK},
                                    ["Block"])
    assert set(device_map.values()) == {"cpu", "disk"} and device_map["embed"] == "cpu"


def test_unknown_strategy():
    with pytest.raises(DeviceMapError) as info:
        resolve_device_map(empty_model(), "fastest")
    assert info.value.valid == ["auto", "balanced", "balanced_low_0", "sequential"]


def test_unknown_module_names_warn_with_close_ones_and_are_dropped():
    with pytest.warns(UserWarning, match=r"'block.0'.*'blocks.0'"):
        checked = check_device_map(empty_model(), {"": "cpu", "block.0": "disk"})
    assert checked == {"": "cpu"}


def test_direct_buffers_of_a_split_module_go_with_its_first_part():
    # the planner (as Accelerate's) never places a split block's own buffer ("gate")
    device_map = {"embed": "cpu", "blocks.0.norm": "cpu", "blocks.0.up": "disk",
                  "blocks.0.down": "disk", "blocks.1": "disk", "blocks.2": "disk",
                  "blocks.3": "disk", "norm": "disk", "head": "cpu", "positions": "disk"}
    assert check_device_map(empty_model(), device_map) == {**device_map, "blocks.0.gate": "cpu"}


@pytest.mark.parametrize("device", ["gpu", 0, "cuda:0", "cuda", 1.5, torch.device("cuda", 2)])
def test_unknown_devices(device):
    with pytest.raises(DeviceMapError) as info:
        check_device_map(empty_model(), {"": device}, on_this_machine=True)  # as dispatch and loading check
    assert info.value.key == ""
    assert "'cpu', 'disk'" in str(info.value)


@pytest.mark.parametrize("device", ["gpu", 1.5, "cuda:x"])
def test_non_devices_are_refused_even_when_planning(device):
    with pytest.raises(DeviceMapError) as info:
        check_device_map(empty_model(), {"": device})
    assert info.value.key == ""


def test_a_map_for_gpus_this_machine_lacks_passes_the_check_but_not_dispatch():
    from nbaccel.big_modeling.dispatch import dispatch_model

    gpus = torch.cuda.device_count()
    planned = {"": gpus, "embed": "cpu"}  # GPU index `gpus` is never visible here
    assert check_device_map(empty_model(), planned) == planned
    with pytest.raises(DeviceMapError):
        dispatch_model(torch.nn.Linear(2, 2), {"": gpus})


def test_devices_are_normalized():
    assert check_device_map(empty_model(), {"": torch.device("cpu")}) == {"": "cpu"}


def test_map_must_cover_every_tensor():
    with pytest.raises(DeviceMapError) as info:
        check_device_map(empty_model(), {"embed": "cpu", "blocks": "cpu"})
    assert info.value.key == "norm.weight"


def test_map_must_be_a_dict():
    with pytest.raises(DeviceMapError) as info:
        check_device_map(empty_model(), ["cpu"])
    assert info.value.key == "device_map"


def test_longest_prefix_wins():
    assert device_for("blocks.10.up.weight", {"blocks.1": "disk", "blocks": "cpu"}) == "cpu"
    assert device_for("x", {}) is None


def _two_big_then_small():
    """Two 16640 B leaves, then a container of two 80 B leaves (33440 B in all)."""
    return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64),
                         nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))


def test_fallback_allocation_puts_a_piece_that_fits_on_a_device_that_would_stay_empty():
    # 16750 B of CPU less the 16640 B kept free to run the second big layer leaves 110 B: "0"
    # never fits, and without a fallback the whole model goes to disk
    assert infer_auto_device_map(_two_big_then_small(), {"cpu": 16_750}) == {"": "disk"}
    device_map = infer_auto_device_map(_two_big_then_small(), {"cpu": 16_750},
                                       fallback_allocation=True)
    assert device_map == {"0": "disk", "1": "disk", "2.0": "cpu", "2.1": "disk"}
    assert check_device_map(_two_big_then_small(), device_map) == device_map
    # nothing fits at all: the device stays empty, as without the fallback
    assert infer_auto_device_map(_two_big_then_small(), {"cpu": 16_700},
                                 fallback_allocation=True) == {"": "disk"}


def test_fallback_allocation_never_breaks_a_no_split_block():
    device_map = infer_auto_device_map(empty_model(), {"cpu": BLOCK + 1000}, ["Block"],
                                       fallback_allocation=True)
    assert device_map["norm"] == "cpu" and device_map["blocks"] == "disk"
    assert list(device_map.values()).count("cpu") == 1


def test_infer_auto_device_map_takes_accelerates_arguments():
    accelerate_utils = pytest.importorskip("accelerate.utils")
    ours = list(inspect.signature(infer_auto_device_map).parameters)
    assert ours == list(inspect.signature(accelerate_utils.infer_auto_device_map).parameters)
