"""Small helpers Accelerate's users import from ``accelerate.utils``: the same calls give the same results."""

from __future__ import annotations

import collections
import importlib
import os

import pytest
import torch
from torch import nn

from nbaccel.errors import ConfigError
from tests.training.helpers import launch

pytest.importorskip("accelerate")

Pair = collections.namedtuple("Pair", "a b")


def utils(lib: str):
    return importlib.import_module(f"{lib}.utils")


class modeling:  # Accelerate keeps some of these in accelerate.utils.modeling only
    def __init__(self, lib: str) -> None:
        self.lib = lib

    def __getattr__(self, name: str):
        if self.lib == "nbaccel":
            return getattr(utils("nbaccel"), name)
        return getattr(utils("accelerate"), name, None) or getattr(
            importlib.import_module("accelerate.utils.modeling"), name)


def helpers(lib: str) -> dict:
    u = utils(lib)
    os.environ["NBACCEL_T12_FLAG"], os.environ["NBACCEL_T12_RANK"] = "on", "3"
    try:
        env = (u.parse_flag_from_env("NBACCEL_T12_FLAG"), u.parse_flag_from_env("NBACCEL_T12_UNSET", True),
               u.parse_choice_from_env("NBACCEL_T12_FLAG"), u.parse_choice_from_env("NBACCEL_T12_UNSET", "fp16"),
               u.get_int_from_env(["NBACCEL_T12_UNSET", "NBACCEL_T12_RANK"], 0), u.get_int_from_env(["X_T12"], 7))
    finally:
        del os.environ["NBACCEL_T12_FLAG"], os.environ["NBACCEL_T12_RANK"]
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 4)))
    weight = torch.ones(4)
    return {
        "bools": [u.str_to_bool(v) for v in ("YES", "t", "off", "0")] + [u.str_to_bool("on", to_bool=True)],
        "env": env,
        "honor": (u.honor_type(Pair(1, 2), iter([3, 4])), u.honor_type([1], (x for x in (5, 6)))),
        "is_tensor": (u.is_torch_tensor(torch.ones(1)), u.is_torch_tensor([1])),
        "merged": u.merge_dicts({"a": {"b": 1}, "c": 2}, {"a": {"d": 3}}),
        "getattr": u.recursive_getattr(model, "1.0.out_features"),
        "bytes": [u.convert_bytes(n) for n in (100, 1536, 5 * 1024**2 + 7, 3 * 1024**5)],
        "bottom_up": [type(m).__name__ for m in modeling(lib).get_module_children_bottom_up(model)],
        "bottom_up_names": [n for n, _ in modeling(lib).get_module_children_bottom_up(model, return_fqns=True)],
        "storage": modeling(lib).id_tensor_storage(weight[:2]) == modeling(lib).id_tensor_storage(weight),
        "max_sizes": u.calculate_maximum_sizes(model),
        "enums": ([m.value for m in u.RNGType], [m.value for m in u.PrecisionType]),
    }


def test_small_helpers_match():
    theirs, ours = helpers("accelerate"), helpers("nbaccel")
    assert ours == theirs
    assert ours["bools"] == [1, 1, 0, 0, True] and ours["env"] == (True, True, "on", "fp16", 3, 7)
    assert ours["merged"] == {"a": {"d": 3, "b": 1}, "c": 2} and ours["bottom_up_names"][-1] == ""


def test_str_to_bool_refuses_other_text_as_accelerate_does():
    for lib in ("accelerate", "nbaccel"):
        with pytest.raises(ValueError, match="invalid truth value"):
            utils(lib).str_to_bool("maybe")


def test_release_memory_returns_nones_and_frees_the_objects():
    import weakref

    for lib in ("accelerate", "nbaccel"):
        model, tensor = nn.Linear(2, 2), torch.ones(3)
        ref = weakref.ref(model)
        model, tensor = utils(lib).release_memory(model, tensor)
        assert (model, tensor) == (None, None) and ref() is None


def test_tied_parameters_on_different_devices_are_logged(caplog):
    for lib in ("accelerate", "nbaccel"):
        caplog.clear()
        with caplog.at_level("WARNING"):
            modeling(lib).check_tied_parameters_on_same_device([["0.weight", "1.weight"]], {"0": 0, "1": "cpu"})
            modeling(lib).check_tied_parameters_on_same_device([["0.weight", "1.weight"]], {"": "cpu"})
        assert caplog.text.count("Tied parameters are on different devices") == 1, lib


def synced(library: str) -> dict:
    lib = importlib.import_module(library)
    u = utils(library)
    if library == "accelerate":
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
    state = lib.Accelerator(cpu=True)  # Accelerate's RNG sync needs its AcceleratorState
    torch.manual_seed(10 + state.process_index)
    u.synchronize_rng_state(u.RNGType.TORCH)
    draw = torch.rand(2)
    u.wait_for_everyone()
    return {"draw": draw}


def test_synchronize_rng_state_and_wait_for_everyone_match():
    ours, theirs = launch(synced, 2, "nbaccel"), launch(synced, 2, "accelerate")
    for rank in (0, 1):
        assert torch.equal(ours[rank]["draw"], theirs[rank]["draw"])
    assert torch.equal(ours[0]["draw"], ours[1]["draw"])
    with pytest.raises(ConfigError) as info:  # hardware nbaccel has no engine for
        utils("nbaccel").synchronize_rng_state(utils("nbaccel").RNGType.NPU)
    assert info.value.key == "rng_types"


def storage_and_samplers(lib: str) -> dict:
    from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

    u = utils(lib)
    importlib.import_module(lib).PartialState(cpu=True)  # Accelerate's logger needs its state
    loader_module = importlib.import_module(f"{lib}.data_loader")
    weight = torch.ones(2, 2)
    cleaned = modeling(lib).clean_state_dict_for_safetensors({"a": weight, "b": weight, "c": torch.zeros(1)})
    shuffled = DataLoader(range(4), batch_size=2, shuffle=True)
    batches = DataLoader(range(4), sampler=BatchSampler(SequentialSampler(range(4)), 2, False), batch_size=None)
    return {"cleaned": sorted(cleaned), "contiguous": all(t.is_contiguous() for t in cleaned.values()),
            "samplers": [type(loader_module.get_sampler(d)).__name__ for d in (shuffled, batches)],
            "batch_sizes": [u.ignorant_find_batch_size(x) for x in ({"x": torch.ones(3, 1)}, "text", [torch.ones(5)])],
            "port": u.is_port_in_use(1)}


def test_storage_sampler_and_batch_size_helpers_match():
    theirs, ours = storage_and_samplers("accelerate"), storage_and_samplers("nbaccel")
    assert ours == theirs
    assert ours["cleaned"] == ["a", "c"] and ours["samplers"] == ["RandomSampler", "SequentialSampler"]


def test_load_offloaded_weights_reads_an_offload_folder(tmp_path):
    from accelerate.utils import offload_state_dict

    source = nn.Linear(3, 2)
    offload_state_dict(str(tmp_path), source.state_dict())  # written by Accelerate
    index = __import__("json").loads((tmp_path / "index.json").read_text())
    for lib in ("accelerate", "nbaccel"):
        target = nn.Linear(3, 2, device="meta")
        modeling(lib).load_offloaded_weights(target, index, str(tmp_path))
        assert torch.equal(target.weight, source.weight) and target.weight.device.type == "cpu", lib


def test_get_grad_scaler_matches():
    for kwargs in ({}, {"init_scale": 8.0, "growth_interval": 3}):
        theirs, ours = utils("accelerate").get_grad_scaler(**kwargs), utils("nbaccel").get_grad_scaler(**kwargs)
        assert type(ours) is type(theirs) and ours.get_scale() == theirs.get_scale()
        assert ours.get_growth_interval() == theirs.get_growth_interval()


def autocast_dtype(library: str) -> list:
    lib = importlib.import_module(library)
    u = utils(library)
    if library == "accelerate":
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
    lib.Accelerator(cpu=True)  # the launch's mixed precision
    seen = []
    for native_amp in (False, True):
        with u.get_mixed_precision_context_manager(native_amp=native_amp):
            seen.append(str(nn.Linear(2, 2)(torch.ones(1, 2)).dtype))
    return seen


def test_get_mixed_precision_context_manager_matches_in_a_bf16_launch():
    import nbaccel

    ours, theirs = (nbaccel.notebook_launcher(autocast_dtype, (lib,), num_processes=2, use_cpu=True,
                                              mixed_precision="bf16", return_all=True, timeout=120)
                    for lib in ("nbaccel", "accelerate"))
    assert ours == theirs == {0: ["torch.float32", "torch.bfloat16"], 1: ["torch.float32", "torch.bfloat16"]}


def test_load_and_load_state_dict_match(tmp_path, caplog):
    import accelerate
    import numpy as np
    from safetensors.torch import save_file

    accelerate.PartialState(cpu=True)  # Accelerate's logger needs its state
    torch.save({"w": torch.ones(2), "rng": np.arange(3, dtype=np.uint32)}, tmp_path / "state.bin")
    tensors = {"a.weight": torch.arange(4.0), "b.weight": torch.ones(2, 2)}
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    for lib in ("accelerate", "nbaccel"):
        loaded = utils(lib).load(str(tmp_path / "state.bin"))
        assert torch.equal(loaded["w"], torch.ones(2)) and loaded["rng"].tolist() == [0, 1, 2], lib
        for device_map in (None, {"a": "cpu", "b": "disk"}):
            state = modeling(lib).load_state_dict(str(tmp_path / "model.safetensors"), device_map=device_map)
            assert sorted(state) == sorted(tensors) and all(torch.equal(state[k], tensors[k]) for k in tensors), lib
            assert {t.device.type for t in state.values()} == {"cpu"}
        torch.save({"x": nn.Linear(1, 1)}, tmp_path / "code.bin")
        with pytest.raises(Exception, match="Weights only load failed"):  # weights_only by default in both
            utils(lib).load(str(tmp_path / "code.bin"))


def test_load_state_dict_refuses_another_frameworks_file_as_a_value_error(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.ones(1)}, tmp_path / "tf.safetensors", metadata={"format": "tf"})
    for lib in ("accelerate", "nbaccel"):
        with pytest.raises(ValueError, match="tf"):
            modeling(lib).load_state_dict(str(tmp_path / "tf.safetensors"))


def structures(lib: str) -> dict:
    u = utils(lib)
    data = {"x": torch.ones(2, 3, dtype=torch.float16), "y": [torch.zeros(4, dtype=torch.int64)]}
    described = u.get_data_structure(data)
    made = u.initialize_tensors(described)
    return {"described": {"x": (tuple(described["x"].shape), described["x"].dtype),
                          "y": (tuple(described["y"][0].shape), described["y"][0].dtype)},
            "is_info": (u.is_tensor_information(described["x"]), u.is_tensor_information(data["x"])),
            "made": {"x": (tuple(made["x"].shape), made["x"].dtype),
                     "y": (tuple(made["y"][0].shape), made["y"][0].dtype)}}


def test_data_structures_describe_and_rebuild_as_in_accelerate():
    theirs, ours = structures("accelerate"), structures("nbaccel")
    assert ours == theirs
    assert ours["made"] == ours["described"] == {"x": ((2, 3), torch.float16), "y": ((4,), torch.int64)}
