"""Empty init, the hook protocol, and dispatching models with offload."""

from __future__ import annotations

import json
import os
from collections import namedtuple

import pytest
import torch
from torch import nn

from nbaccel.big_modeling import (
    AlignDevicesHook,
    ModelHook,
    SequentialHook,
    add_hook_to_module,
    cpu_offload,
    cpu_offload_with_hook,
    disk_offload,
    dispatch_model,
    infer_auto_device_map,
    init_empty_weights,
    init_on_device,
    load_checkpoint_and_dispatch,
    load_checkpoint_in_model,
    remove_hook_from_module,
    set_module_tensor_to_device,
)
from nbaccel.big_modeling.tensors import find_device
from nbaccel.errors import CheckpointError, CheckpointMismatchError, ConfigError, DeviceMapError
from nbaccel.nested_data import send_to_device
from tests.big_modeling.helpers import (
    TinyLM,
    empty_model,
    make_model,
    sample_ids,
    save_checkpoint,
)


@pytest.fixture(scope="module")
def reference():
    with torch.no_grad():
        return make_model()(sample_ids())


# --- empty init -------------------------------------------------------------------------------

def test_empty_init_puts_parameters_on_meta_and_keeps_buffers():
    with init_empty_weights():
        model = TinyLM(width=4096, blocks=8)  # about 1.3 GB of fp32 weights
    assert all(p.is_meta for p in model.parameters())
    assert not model.positions.is_meta and not model.blocks[0].gate.is_meta
    assert model.head.weight is model.embed.weight
    assert nn.Module.register_parameter.__name__ == "register_parameter"


def test_empty_init_with_buffers_and_on_a_device():
    with init_empty_weights(include_buffers=True):
        model = TinyLM()
    assert model.positions.is_meta
    with init_on_device("cpu"):
        frozen = nn.Linear(2, 2)
        frozen.weight.requires_grad_(False)
    assert frozen.weight.device.type == "cpu"


def test_empty_init_keeps_requires_grad_and_undoes_its_patch_on_error():
    original = nn.Module.register_parameter
    with pytest.raises(RuntimeError), init_empty_weights():
        module = nn.Module()
        module.register_parameter("p", nn.Parameter(torch.ones(1), requires_grad=False))
        assert module.p.is_meta and not module.p.requires_grad
        raise RuntimeError("boom")
    assert nn.Module.register_parameter is original


# --- hooks ------------------------------------------------------------------------------------

class Record(ModelHook):
    def __init__(self, log, tag):
        self.log, self.tag = log, tag

    def init_hook(self, module):
        self.log.append(f"init {self.tag}")
        return module

    def pre_forward(self, module, *args, **kwargs):
        self.log.append(f"pre {self.tag}")
        return (args[0] + 1,), kwargs

    def post_forward(self, module, output):
        self.log.append(f"post {self.tag}")
        return output * 10

    def detach_hook(self, module):
        self.log.append(f"detach {self.tag}")
        return module


def test_hooks_wrap_forward_chain_in_order_and_come_off():
    log, module = [], nn.Identity()
    original = module.forward
    add_hook_to_module(module, Record(log, "a"))
    add_hook_to_module(module, Record(log, "b"), append=True)
    assert isinstance(module._hf_hook, SequentialHook)
    assert module(torch.zeros(1)).item() == 200.0  # (0 + 1 + 1) * 10 * 10
    assert log == ["init a", "detach a", "init a", "init b", "pre a", "pre b", "post a",
                   "post b"]
    remove_hook_from_module(module)
    assert module.forward == original and not hasattr(module, "_hf_hook")
    assert log[-2:] == ["detach a", "detach b"]


def test_replacing_a_hook_wraps_the_original_forward_once():
    module = add_hook_to_module(nn.Identity(), Record([], "a"))
    add_hook_to_module(module, Record([], "b"))
    assert module(torch.zeros(1)).item() == 10.0


def test_no_grad_hooks():
    class NoGrad(ModelHook):
        no_grad = True

    lin = add_hook_to_module(nn.Linear(2, 2), NoGrad())
    assert not lin(torch.ones(1, 2)).requires_grad


def test_remove_recurses_and_restores_offloaded_weights():
    model = make_model()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    cpu_offload(model, "cpu")
    assert model.blocks[0].up.weight.is_meta
    remove_hook_from_module(model, recurse=True)
    assert not any(hasattr(m, "_hf_hook") for m in model.modules())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in expected.items())


def test_align_devices_hook_offloads_between_calls():
    lin = nn.Linear(3, 3)
    x = torch.randn(2, 3)
    ref = lin(x)
    add_hook_to_module(lin, AlignDevicesHook("cpu", offload=True, io_same_device=True))
    assert lin.weight.is_meta
    assert torch.equal(lin(x), ref) and lin.weight.is_meta
    assert "offload=True" in repr(lin._hf_hook)


class _Scale(nn.Module):  # a buffer and no parameter: nothing an offload hook without buffers loads
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("s", torch.full((3,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.s


def test_an_offload_hook_without_a_device_says_so():
    # it used to fail inside torch.device(None) with a TypeError that named no argument
    lin = add_hook_to_module(nn.Linear(3, 3), AlignDevicesHook(offload=True))
    with pytest.raises(ConfigError, match="no execution_device"):
        lin(torch.ones(1, 3))
    assert lin.weight.is_meta
    scale = add_hook_to_module(_Scale(), AlignDevicesHook(offload=True))  # nothing to load: runs where it is
    assert torch.equal(scale(torch.ones(3)), torch.full((3,), 2.0))


def test_align_devices_hook_to_meta():
    lin = add_hook_to_module(nn.Linear(3, 3), AlignDevicesHook("meta", place_submodules=True))
    assert lin.weight.is_meta


def test_send_to_device_and_find_device():
    Pair = namedtuple("Pair", "a b")
    data = {"x": [torch.ones(1), (Pair(torch.zeros(1), 3),)], "mask": torch.ones(1)}
    moved = send_to_device(data, "meta", skip_keys="mask")
    assert moved["x"][0].is_meta and moved["x"][1][0].a.is_meta and moved["x"][1][0].b == 3
    assert not moved["mask"].is_meta
    assert find_device([1, {"a": moved["x"][0]}]) == torch.device("meta")
    assert find_device([1, "a"]) is None


def test_set_module_tensor_errors():
    lin = nn.Linear(2, 2)
    with pytest.raises(DeviceMapError) as info:
        set_module_tensor_to_device(lin, "wieght", "cpu")
    assert info.value.key == "wieght"
    with pytest.raises(DeviceMapError):
        set_module_tensor_to_device(nn.Sequential(lin), "1.weight", "cpu")
    with pytest.raises(CheckpointMismatchError) as info:
        set_module_tensor_to_device(lin, "weight", "cpu", value=torch.ones(3, 2))
    assert info.value.mismatched_shapes == {"weight": ((3, 2), (2, 2))}
    set_module_tensor_to_device(lin, "bias", "cpu", value=torch.ones(2, dtype=torch.float64))
    assert lin.bias.dtype == torch.float32 and isinstance(lin.bias, nn.Parameter)
    set_module_tensor_to_device(lin, "bias", "cpu", dtype="torch.float16")
    assert lin.bias.dtype == torch.float16


# --- dispatch ---------------------------------------------------------------------------------

def test_dispatch_a_materialized_model_with_overlapping_entries(reference):
    model = dispatch_model(make_model(), {"": "cpu", "blocks.1": "disk", "blocks.1.up": "disk"})
    assert model.blocks[1].up.weight.is_meta and not model.blocks[0].up.weight.is_meta
    assert torch.equal(model(sample_ids()), reference)


def test_dispatch_of_single_tensors_and_one_device(reference):
    model = make_model()
    device_map = {"embed": "cpu", "positions": "disk", "blocks": "cpu", "norm.weight": "disk",
                  "norm.bias": "disk", "head": "cpu"}
    model = dispatch_model(model, device_map)
    assert model.norm.weight.is_meta and model.positions.is_meta is False  # buffers stay
    assert torch.equal(model(sample_ids()), reference)
    single = dispatch_model(make_model(), {"": "cpu"})
    assert not hasattr(single, "_hf_hook") and single.hf_device_map == {"": "cpu"}


def test_dispatch_rejects_a_module_split_across_devices():
    with pytest.raises(DeviceMapError) as info:
        dispatch_model(make_model(), {"embed": "cpu", "positions": "cpu", "blocks": "cpu",
                                      "norm.weight": "cpu", "norm.bias": "disk", "head": "cpu"})
    assert info.value.key == "norm.bias"


def test_dispatch_of_unloaded_weights_is_an_error():
    with pytest.raises(CheckpointMismatchError) as info:
        dispatch_model(empty_model(), {"": "cpu"})
    assert "embed.weight" in info.value.missing_keys
    with pytest.raises(CheckpointMismatchError) as info:
        dispatch_model(empty_model(), {"": "cpu", "blocks.0": "disk"})
    assert info.value.missing_keys[0] == "embed.weight"
    with pytest.raises(CheckpointMismatchError) as info:
        dispatch_model(empty_model(), {"": "disk"})
    assert info.value.missing_keys == ("embed.weight",)


def test_dispatch_to_meta_keeps_shapes_only():
    model = dispatch_model(empty_model(), {"": "meta"})
    assert model.hf_device_map == {"": "meta"}


def test_cpu_offload_and_disk_offload_give_the_same_outputs(reference, tmp_path):
    assert torch.equal(cpu_offload(make_model(), "cpu")(sample_ids()), reference)
    assert torch.equal(cpu_offload(make_model(), offload_buffers=True)(sample_ids()), reference)
    folder = tmp_path / "offload"
    model = disk_offload(make_model(), folder, "cpu")
    assert model.blocks[0].up.weight.is_meta and (folder / "index.json").exists()
    assert torch.equal(model(sample_ids()), reference)
    again = disk_offload(TinyLM(), folder, offload_buffers=True)  # reuses the folder's weights
    assert torch.equal(again(sample_ids()), reference)


def test_cpu_offload_with_hook_runs_a_pipeline():
    first, second = nn.Linear(2, 3), nn.Linear(3, 1)
    x = torch.ones(1, 2)
    ref = second(first(x))
    first, hook_a = cpu_offload_with_hook(first, "cpu")
    second, hook_b = cpu_offload_with_hook(second, prev_module_hook=hook_a)
    assert torch.equal(second(first(x)), ref)
    hook_b.offload()
    hook_a.remove()
    assert not hasattr(first, "_hf_hook")


def test_each_offloaded_submodule_prefetches_the_next_ones_weights(tmp_path, reference):
    checkpoint = save_checkpoint(make_model(), tmp_path / "ckpt", shards=2)
    model = load_checkpoint_and_dispatch(empty_model(), checkpoint, {
        "embed": "cpu", "positions": "cpu", "blocks": "disk", "norm": "cpu", "head": "cpu"})
    loader = model.blocks[2].up._hf_hook.weights_map.dataset
    seen = {}
    holders = [n for n, m in model.named_modules() if n.startswith("blocks.")
               and next(m.parameters(recurse=False), None) is not None]
    for name in holders:
        model.get_submodule(name).register_forward_pre_hook(
            lambda m, a, name=name: seen.__setitem__(name, sorted(loader._pending)))
    assert torch.equal(model(sample_ids()), reference)
    # before each offloaded submodule loads, its own weights are already being read
    assert seen == {n: [] if n == "blocks.0.norm" else [f"{n}.bias", f"{n}.weight"]
                    for n in holders}
    assert sorted(loader._pending) == []  # nothing held after the last block


def test_a_disk_only_map_holds_one_submodules_weights_at_a_time(tmp_path, reference):
    checkpoint = save_checkpoint(make_model(), tmp_path / "ckpt")
    model = empty_model()
    device_map = infer_auto_device_map(model, {"cpu": 1000}, ["Block"])
    assert device_map == {"": "disk"}
    model = load_checkpoint_and_dispatch(model, checkpoint, device_map)
    held = {}

    class Spy(ModelHook):  # appended, so it runs after the offload hook has loaded weights
        def __init__(self, name):
            self.name = name

        def pre_forward(self, module, *args, **kwargs):
            held[self.name] = sorted(n for n, p in model.named_parameters(
                remove_duplicate=False) if not p.is_meta)
            return args, kwargs

    for i in range(len(model.blocks)):
        add_hook_to_module(model.blocks[i].up, Spy(f"blocks.{i}.up"), append=True)
    assert torch.equal(model(sample_ids()), reference)
    assert held == {f"blocks.{i}.up": [f"blocks.{i}.up.bias", f"blocks.{i}.up.weight"]
                    for i in range(len(model.blocks))}
    assert all(p.is_meta for p in model.parameters())


class UsesChildWeights(nn.Module):
    """Reads ``inner``'s weights without calling ``inner``."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x):
        return nn.functional.linear(x, self.inner.weight, self.inner.bias)


class ScaledLinear(nn.Module):
    """Scales by a ``ParameterList``, a child with no forward of its own."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scales = nn.ParameterList([nn.Parameter(torch.full((4,), 2.0))])

    def forward(self, x):
        return self.lin(x) * self.scales[0]


@pytest.mark.parametrize("cls", [UsesChildWeights, ScaledLinear])
def test_weights_used_without_calling_their_module_are_loaded(cls):
    x = torch.randn(2, 4)
    full = cls()
    ref = full(x)
    preload = ["UsesChildWeights"] if cls is UsesChildWeights else None
    model = dispatch_model(full, {"": "disk"}, preload_module_classes=preload)
    assert torch.equal(model(x), ref) and all(p.is_meta for p in model.parameters())


def test_without_preload_a_child_read_directly_is_still_on_meta():
    with pytest.raises((RuntimeError, NotImplementedError)):
        dispatch_model(UsesChildWeights(), {"": "disk"})(torch.randn(2, 4))


CORRUPTED = "blocks.1.up.weight"


def _point_at_a_missing_file(folder, index):
    index[CORRUPTED]["safetensors_file"] = str(folder / "gone.safetensors")
    return CORRUPTED, str(folder / "gone.safetensors")


def _name_a_weight_the_file_lacks(folder, index):
    index[CORRUPTED]["weight_name"] = "blocks.1.up.wieght"
    return "blocks.1.up.wieght", index[CORRUPTED]["safetensors_file"]


def _delete_a_dat_file(folder, index):
    os.remove(folder / f"{CORRUPTED}.dat")
    return CORRUPTED, str(folder / f"{CORRUPTED}.dat")


def _truncate_a_dat_file(folder, index):
    path = folder / f"{CORRUPTED}.dat"
    path.write_bytes(path.read_bytes()[:-4])
    return CORRUPTED, str(path)


def _forget_the_folder(folder, index):
    return "embed.weight", None  # the first offloaded weight read


@pytest.mark.parametrize("kind,corrupt", [
    ("safetensors", _point_at_a_missing_file), ("safetensors", _name_a_weight_the_file_lacks),
    ("bin", _delete_a_dat_file), ("bin", _truncate_a_dat_file), ("bin", _forget_the_folder)])
def test_a_broken_offload_index_or_folder_names_the_weight_and_file(tmp_path, kind, corrupt):
    folder = tmp_path / "offload"
    model = empty_model()
    load_checkpoint_in_model(model, save_checkpoint(make_model(), tmp_path / "ckpt", kind),
                             {"": "disk"}, offload_folder=folder)
    index = json.loads((folder / "index.json").read_text())
    key, path = corrupt(folder, index)
    keep_folder = corrupt is not _forget_the_folder
    model = dispatch_model(model, {"": "disk"}, offload_dir=folder if keep_folder else None,
                           offload_index=index)
    with pytest.raises(CheckpointError) as info:
        model(sample_ids())
    assert (info.value.key, info.value.path) == (key, path)
    assert key in str(info.value) and (path is None or path in str(info.value))


def test_offloaded_weights_loader_is_a_mapping_that_refuses_unknown_names(tmp_path):
    from nbaccel import OffloadedWeightsLoader
    from nbaccel.big_modeling.offload import offload_state_dict

    offload_state_dict(tmp_path, {"w": torch.ones(3)})
    weights = OffloadedWeightsLoader(state_dict={"b": torch.zeros(1)}, save_folder=tmp_path)
    assert sorted(weights) == ["b", "w"] and torch.equal(weights["w"], torch.ones(3))
    with pytest.raises(KeyError, match="missing"):
        weights["missing"]
