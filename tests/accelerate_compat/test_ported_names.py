"""The names issue 12 found missing: the same code through Accelerate and nbaccel gives the same results.

One process here; the collectives and DDP methods run in two processes in ``test_ported_collectives``.
"""

from __future__ import annotations

import collections
import importlib
import logging
import types
import os
import warnings

import pytest
import torch
from torch import nn

import nbaccel
from nbaccel.errors import ConfigError, DistributedOperationError

pytest.importorskip("accelerate")

LIBRARIES = ["accelerate", "nbaccel"]


def both(function, *args):
    """``function(library, *args)`` for Accelerate and nbaccel: (theirs, ours)."""
    return tuple(function(lib, *args) for lib in LIBRARIES)


def utils(lib: str):
    return importlib.import_module(f"{lib}.utils")


def hooks(lib: str):
    return importlib.import_module(f"{lib}.hooks")


Point = collections.namedtuple("Point", "x y")


def nested(lib: str) -> dict:
    u = utils(lib)
    data = {"a": torch.tensor([1.5, 2.0], dtype=torch.bfloat16), "b": (torch.tensor(3), [torch.ones(2, 2)]),
            "p": Point(torch.tensor([1, 2], dtype=torch.float16), "text")}
    fp32 = u.convert_to_fp32(data)
    return {"listify": u.listify(data),
            "fp32_dtypes": {k: str(v.dtype) for k, v in [("a", fp32["a"]), ("b0", fp32["b"][0]), ("px", fp32["p"].x)]},
            "fp32_is_namedtuple": type(fp32["p"]).__name__,
            "is_nt": (u.is_namedtuple(data["p"]), u.is_namedtuple((1,)))}


def test_listify_convert_to_fp32_and_is_namedtuple_match():
    theirs, ours = both(nested)
    assert ours == theirs
    assert ours["fp32_dtypes"] == {"a": "torch.float32", "b0": "torch.int64", "px": "torch.float32"}
    assert ours["listify"]["a"] == [1.5, 2.0] and ours["is_nt"] == (True, False)


@pytest.mark.parametrize("batch_size,num_processes", [(3, 4), (1, 2), (5, 4), (7, 8)])
def test_pad_input_tensors_matches_where_accelerate_pads_to_a_multiple(batch_size, num_processes):
    tensor = torch.arange(batch_size * 2, dtype=torch.float32).reshape(batch_size, 2)
    theirs, ours = both(lambda lib: utils(lib).pad_input_tensors({"x": tensor}, batch_size, num_processes))
    assert ours["x"].shape[0] % num_processes == 0
    assert torch.equal(ours["x"], theirs["x"])


def test_pad_input_tensors_pads_to_a_multiple_where_accelerate_does_not():
    """A documented difference: Accelerate turns 6 rows over 4 processes into 9 (not a multiple)."""
    tensor = torch.ones(6, 1)
    theirs, ours = both(lambda lib: utils(lib).pad_input_tensors(tensor, 6, 4))
    assert (theirs.shape[0], ours.shape[0]) == (9, 8)
    assert torch.equal(ours[:6], tensor) and torch.equal(ours[6:], torch.zeros(2, 1))
    assert torch.equal(utils("nbaccel").pad_input_tensors(torch.ones(8, 1), 8, 4), torch.ones(8, 1))
    with pytest.raises(ConfigError) as info:
        utils("nbaccel").pad_input_tensors(tensor, 6, 0)
    assert info.value.key == "num_processes" and info.value.value == 0


def environments(lib: str) -> list:
    u = utils(lib)
    os.environ.pop("NBACCEL_T12_A", None)
    os.environ["NBACCEL_T12_B"] = "before"
    seen = []
    with u.patch_environment(nbaccel_t12_a=1, NBACCEL_T12_B=2.5):
        seen.append((os.environ["NBACCEL_T12_A"], os.environ["NBACCEL_T12_B"]))
    seen.append((os.environ.get("NBACCEL_T12_A"), os.environ["NBACCEL_T12_B"]))
    with u.clear_environment():
        seen.append(len(os.environ))
        os.environ["NBACCEL_T12_C"] = "inside"
    seen.append(("NBACCEL_T12_C" in os.environ, os.environ["NBACCEL_T12_B"]))
    del os.environ["NBACCEL_T12_B"]
    return seen


def test_patch_and_clear_environment_match():
    theirs, ours = both(environments)
    assert ours == theirs == [("1", "2.5"), (None, "before"), 0, (False, "before")]


def model_helpers(lib: str) -> dict:
    torch.manual_seed(0)
    u = utils(lib)
    modeling = importlib.import_module(f"{lib}.utils.modeling") if lib == "accelerate" else u
    offload = importlib.import_module(f"{lib}.utils.offload") if lib == "accelerate" else u
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 3))
    model[1].register_buffer("mask", torch.ones(3), persistent=False)
    model[2].weight = model[0].weight  # tied
    sizes = u.compute_module_sizes(model)
    tied = u.find_tied_parameters(model)
    ties = modeling.get_module_size_with_ties(["2.weight"], sizes["2"], sizes, [("0", model[0]), ("2", model[2])])
    device_map = {"0": 0, "1.weight": 0, "1.bias": 0, "2": "cpu", "3.a.x": "disk", "3.a.y": "disk"}
    return {"buffers": sorted(modeling.get_non_persistent_buffers(model, recurse=True)),
            "buffers_fqn": sorted(modeling.get_non_persistent_buffers(model, recurse=True, fqns=True)),
            "buffer_size": modeling.compute_module_total_buffer_size(model),
            "buffer_size_fp16": modeling.compute_module_total_buffer_size(model, dtype=torch.float16),
            "ties": (ties[0], ties[1]), "max_layer": u.get_max_layer_size(list(model.named_children()), sizes, []),
            "clean": modeling.clean_device_map(dict(device_map)),
            "extract": sorted(offload.extract_submodules_state_dict(model.state_dict(), ["1", "2"])),
            "tied": tied}


def test_module_state_helpers_match():
    theirs, ours = both(model_helpers)
    assert ours == theirs
    assert ours["clean"] == {"0": 0, "1": 0, "2": "cpu", "3": "disk"}


def offloaded(lib: str) -> dict:
    torch.manual_seed(0)
    u, h = utils(lib), hooks(lib)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(2, 4)
    expected = model(x)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    h.attach_align_device_hook(model, execution_device="cpu", offload=True, weights_map=state)
    result = {"offloaded": [u.has_offloaded_params(m) for m in model], "device": model[0].weight.device.type,
              "same_output": torch.equal(model(x), expected)}
    with u.align_module_device(model[0]):
        result["aligned"] = model[0].weight.device.type
    result["after"] = model[0].weight.device.type
    modeling = importlib.import_module(f"{lib}.utils.modeling") if lib == "accelerate" else u
    full = modeling.get_state_dict_offloaded_model(model)
    result["state_dict"] = sorted(full)
    result["state_equal"] = all(torch.equal(full[k], state[k]) for k in state)
    h.remove_hook_from_submodules(model)
    result["removed"] = [hasattr(m, "_hf_hook") for m in model]
    tied = nn.Sequential(nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False))
    tied[1].weight = tied[0].weight
    u.set_module_tensor_to_device(tied[1], "weight", "meta")
    result["broken"] = tied[0].weight is tied[1].weight
    u.retie_parameters(tied, [["0.weight", "1.weight"]])
    result["retied"] = tied[0].weight is tied[1].weight and tied[1].weight.device.type == "cpu"
    return result


def test_offload_hooks_and_helpers_match():
    theirs, ours = both(offloaded)
    assert ours == theirs
    assert ours["offloaded"] == [True, False, True] and ours["device"] == "meta" and ours["same_output"]
    assert (ours["aligned"], ours["after"], ours["removed"], ours["retied"]) == ("cpu", "meta", [False] * 3, True)


def layerwise(lib: str) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Conv1d(1, 1, 1), nn.Linear(4, 2))
    model.head = nn.Linear(2, 2)
    attach = importlib.import_module(f"{lib}.big_modeling").attach_layerwise_casting_hooks
    attach(model, torch.bfloat16, torch.float32, skip_modules_pattern=("head",),
           skip_modules_classes=(nn.Conv1d,))
    x = torch.randn(3, 4)
    out = model[3](model[1](model[0](x)))
    return {"dtypes": {n: str(p.dtype) for n, p in model.named_parameters()}, "out": out,
            "out_dtype": str(out.dtype)}


def test_layerwise_casting_matches():
    theirs, ours = both(layerwise)
    assert ours["dtypes"] == theirs["dtypes"]
    assert ours["dtypes"]["0.weight"] == "torch.bfloat16" and ours["dtypes"]["1.weight"] == "torch.float32"
    assert ours["dtypes"]["head.weight"] == ours["dtypes"]["2.weight"] == "torch.float32"
    assert ours["out_dtype"] == theirs["out_dtype"] == "torch.float32"
    assert torch.equal(ours["out"], theirs["out"])


def execution_hooks(lib: str) -> list:
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)), nn.ReLU())
    hooks(lib).attach_execution_device_hook(model, "cpu", preload_module_classes=["Sequential"])
    return [type(getattr(m, "_hf_hook", None)).__name__ for _, m in model.named_modules()]


def test_attach_execution_device_hook_matches():
    theirs, ours = both(execution_hooks)
    assert ours == theirs


def unwrapped(lib: str) -> dict:
    inner = nn.Sequential(nn.Linear(1, 1), nn.DataParallel(nn.Linear(1, 1)))
    wrapped = nn.DataParallel(inner)
    top = utils(lib).extract_model_from_parallel(wrapped)
    deep = utils(lib).extract_model_from_parallel(nn.DataParallel(inner), recursive=True)
    return {"top": top is inner, "child": type(top[1]).__name__, "deep_child": type(deep[1]).__name__}


def test_extract_model_from_parallel_matches():
    theirs, ours = both(unwrapped)
    assert ours == theirs == {"top": True, "child": "Linear", "deep_child": "Linear"}


def saved(lib: str, folder) -> dict:
    u = utils(lib)
    u.save({"w": torch.arange(3)}, folder / f"{lib}.pt")
    u.save(collections.OrderedDict(w=torch.ones(2)), folder / f"{lib}.safetensors", safe_serialization=True)
    from safetensors import safe_open

    with safe_open(folder / f"{lib}.safetensors", "pt") as f:
        meta, w = f.metadata(), f.get_tensor("w")
    return {"pt": torch.load(folder / f"{lib}.pt"), "meta": meta, "w": w}


def test_save_matches(tmp_path):
    theirs, ours = both(saved, tmp_path)
    assert torch.equal(ours["pt"]["w"], theirs["pt"]["w"]) and torch.equal(ours["w"], theirs["w"])
    assert ours["meta"] == theirs["meta"] == {"format": "pt"}


def saved_shared(lib: str, folder, caplog) -> dict:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = self.a

    caplog.clear()
    with caplog.at_level(logging.WARNING):
        utils(lib).save(Tied().state_dict(), folder / f"{lib}.safetensors", safe_serialization=True)
    from safetensors import safe_open

    with safe_open(folder / f"{lib}.safetensors", "pt") as f:
        keys = sorted(f.keys())
    # Accelerate's logger puts "[RANK 0] " first once a state exists
    return {"keys": keys, "logged": [(r.levelname, "Removed shared tensor" in r.getMessage(), "'b.weight'" in
                                      r.getMessage()) for r in caplog.records]}


def test_save_drops_shared_tensors_and_logs_it_as_accelerate_does(tmp_path, caplog):
    theirs, ours = (saved_shared(lib, tmp_path, caplog) for lib in LIBRARIES)
    assert ours == theirs
    assert ours["keys"] == ["a.bias", "a.weight"] and ours["logged"] == [("WARNING", True, True)]


def kernel_logs(lib: str, monkeypatch, caplog) -> list:
    import platform

    importlib.import_module(lib).PartialState()  # Accelerate's logger needs a state
    caplog.clear()
    with monkeypatch.context() as patched:  # Accelerate's own test patches uname the same way
        patched.setattr(platform, "uname", lambda: types.SimpleNamespace(release="5.4.0-35-generic", system="Linux"))
        utils(lib).check_os_kernel()
    return [(r.levelname, "5.4.0" in r.msg, "5.5.0" in r.msg) for r in caplog.records]


def test_check_os_kernel_logs_a_warning_below_5_5_and_is_quiet_here(monkeypatch, caplog):
    from accelerate.utils import check_os_kernel as theirs

    assert theirs() is None and utils("nbaccel").check_os_kernel() is None
    assert kernel_logs("nbaccel", monkeypatch, caplog) == kernel_logs("accelerate", monkeypatch, caplog) == [
        ("WARNING", True, True)]
    assert "below the recommended minimum" in utils("nbaccel").check_os_kernel("4.19.0-generic")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert utils("nbaccel").check_os_kernel("not a version") is None


def test_skip_data_loader_matches():
    data = list(range(10))
    theirs, ours = both(lambda lib: importlib.import_module(f"{lib}.data_loader").SkipDataLoader(
        data, skip_batches=2, batch_size=3))
    assert len(ours) == len(theirs) == 2
    assert [b.tolist() for b in ours] == [b.tolist() for b in theirs] == [[6, 7, 8], [9]]
    with pytest.raises(ConfigError) as info:
        nbaccel.data_loader.SkipDataLoader(data, skip_batches=-1)
    assert info.value.key == "skip_batches"
    with pytest.raises(ConfigError) as info:
        nbaccel.data_loader.SkipDataLoader(data, use_stateful_dataloader=True)
    assert info.value.key == "use_stateful_dataloader"


def test_enums_and_exceptions_match():
    from accelerate.utils import DDPCommunicationHookType as Theirs
    from accelerate.utils import DistributedType as TheirType

    from nbaccel.utils import (
        DDPCommunicationHookType,
        DistributedOperationException,
        DistributedType,
    )

    assert [m.value for m in DDPCommunicationHookType] == [m.value for m in Theirs]
    assert {m.value for m in DistributedType} == {m.value for m in TheirType}
    assert DistributedOperationException is DistributedOperationError
    with pytest.raises(ConfigError) as info:
        nbaccel.DistributedDataParallelKwargs(comm_hook="fp32")
    assert info.value.key == "comm_hook" and "power_sgd" in info.value.valid
    assert nbaccel.DistributedDataParallelKwargs(comm_hook="fp16").to_kwargs() == {}  # not a DDP argument


def reset_states(lib: str) -> list:
    state = importlib.import_module(f"{lib}.state")
    state.AcceleratorState._reset_state(reset_partial_state=True)
    state.GradientState._reset_state()
    seen = [state.is_initialized()]
    state.PartialState()
    seen.append(state.PartialState().initialized)
    state.PartialState._reset_state()
    seen.append(state.PartialState._shared_state == {} if lib == "accelerate" else not state.is_initialized())
    return seen


def test_reset_state_forgets_the_process_state():
    theirs, ours = both(reset_states)
    assert ours == theirs == [False, True, True]


def tensors_listed(lib: str) -> list:
    model = nn.Sequential(nn.BatchNorm1d(2))
    model[0].register_buffer("mask", torch.ones(2), persistent=False)
    model.register_buffer("top", torch.ones(1), persistent=False)
    u = utils(lib)
    return [[n for n, _ in u.named_module_tensors(model[0], remove_non_persistent=flag)] for flag in (False, True)] + [
        [n for n, _ in u.named_module_tensors(model, recurse=False, remove_non_persistent=True)]]


def test_named_module_tensors_can_leave_out_non_persistent_buffers():
    theirs, ours = both(tensors_listed)
    assert ours == theirs
    assert "mask" in ours[0] and "mask" not in ours[1] and ours[2] == []


def planned(lib: str) -> dict:
    u = utils(lib)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])
    budget = {0: 2500, 1: 2500, "cpu": 3000}
    balanced = u.get_balanced_memory(model, max_memory={0: "10KB", 1: "10KB", "cpu": "1MB"})
    return {"map": dict(u.infer_auto_device_map(model, max_memory=budget)), "balanced": balanced}


def test_a_device_map_is_planned_for_gpus_this_machine_does_not_have():
    """Planning is arithmetic: a CPU-only machine plans the map for the GPUs the model will run on."""
    theirs, ours = both(planned)
    assert ours == theirs
    assert ours["map"]["0"] == 0 and ours["map"]["1"] == 1 and "cpu" in ours["map"].values()
    if torch.cuda.device_count() == 0:
        with pytest.raises(ConfigError, match="visible GPU"):  # a budget for this machine still checks
            utils("nbaccel").get_max_memory({0: "1GiB"})


def meta_moves(lib: str) -> list:
    u = utils(lib)
    model = nn.Linear(2, 2)
    u.set_module_tensor_to_device(model, "weight", "meta")
    u.set_module_tensor_to_device(model, "weight", "cpu", value=torch.ones(2, 2))
    seen = [model.weight.device.type, model.weight.sum().item(), type(model.weight).__name__]
    u.set_module_tensor_to_device(model, "bias", "meta")
    try:
        u.set_module_tensor_to_device(model, "bias", "cpu")
    except ValueError:
        seen.append("ValueError")
    return seen


def test_a_meta_tensor_moves_back_with_a_value_and_without_one_is_a_value_error():
    theirs, ours = both(meta_moves)
    assert ours == theirs == ["cpu", 4.0, "Parameter", "ValueError"]


def test_unexpected_checkpoint_keys_are_reported_as_in_accelerate(tmp_path, caplog):
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in nn.Linear(2, 2).state_dict().items()} | {"extra.weight": torch.ones(1)}
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    theirs, ours = nn.Linear(2, 2), nn.Linear(2, 2)
    for lib, model in (("accelerate", theirs), ("nbaccel", ours)):
        caplog.clear()
        with caplog.at_level("WARNING"):
            utils(lib).load_checkpoint_in_model(model, str(tmp_path / "model.safetensors"))
        assert "extra.weight" in caplog.text, lib  # both log it and go on
    assert torch.equal(ours.weight, theirs.weight) and torch.equal(ours.weight, state["weight"])


def test_check_device_map_accepts_a_map_planned_for_gpus_as_accelerate_does():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    planned = {"0": 0, "1": "cpu"}
    assert utils("accelerate").check_device_map(model, planned) is None  # Accelerate: no error
    assert utils("nbaccel").check_device_map(model, planned) == planned
    for lib in LIBRARIES:
        with pytest.raises(ValueError):  # a tensor left without a device is an error in both
            utils(lib).check_device_map(model, {"0": 0})
