"""Loading checkpoints and dispatching: outputs equal the fully loaded model's, exactly."""

from __future__ import annotations

import inspect
import json
import os
import warnings

import pytest
import torch

from nbaccel.big_modeling import (
    dispatch_model,
    load_checkpoint_and_dispatch,
    load_checkpoint_in_model,
)
from nbaccel.errors import CheckpointMismatchError, ConfigError, DeviceMapError
from tests.big_modeling.helpers import (
    TinyLM,
    empty_model,
    make_model,
    sample_ids,
    save_checkpoint,
    stored_state,
)

ALL_CPU = {"": "cpu"}
CPU_AND_DISK = {"embed": "cpu", "positions": "cpu", "blocks.0": "cpu", "blocks.1": "disk",
                "blocks.2": "cpu", "blocks.3": "disk", "norm": "disk", "head": "disk"}
DISK_ONLY = {"": "disk"}
MAPS = {"all-cpu": ALL_CPU, "cpu+disk": CPU_AND_DISK, "disk-only": DISK_ONLY}


@pytest.fixture(scope="module")
def full():
    return make_model()


@pytest.fixture(scope="module")
def reference(full):
    with torch.no_grad():
        return full(sample_ids())


@pytest.mark.parametrize("kind,shards", [("safetensors", 1), ("safetensors", 3), ("bin", 1),
                                         ("bin", 3)])
@pytest.mark.parametrize("map_name", list(MAPS))
def test_dispatched_output_equals_the_full_model_exactly(full, reference, tmp_path, kind, shards,
                                                         map_name):
    checkpoint = save_checkpoint(full, tmp_path / "ckpt", kind, shards)
    model = load_checkpoint_and_dispatch(empty_model(), checkpoint, MAPS[map_name],
                                         offload_folder=tmp_path / "offload")
    with torch.no_grad():
        first, second = model(sample_ids()), model(sample_ids())
    assert torch.equal(first, reference) and torch.equal(second, reference)
    assert model.hf_device_map == MAPS[map_name]
    if map_name != "all-cpu":  # offloaded weights are released after each call
        assert model.blocks[1].up.weight.is_meta and model.norm.weight.is_meta


def test_folder_checkpoints_load_the_same(full, reference, tmp_path):
    save_checkpoint(full, tmp_path / "sharded", "safetensors", shards=2)
    save_checkpoint(full, tmp_path / "single", "bin")
    for folder in ("sharded", "single"):
        model = load_checkpoint_and_dispatch(empty_model(), tmp_path / folder, CPU_AND_DISK,
                                             offload_folder=tmp_path / f"off-{folder}")
        assert torch.equal(model(sample_ids()), reference)


def test_safetensors_disk_offload_writes_nothing_and_needs_no_folder(full, reference, tmp_path):
    checkpoint = save_checkpoint(full, tmp_path / "ckpt", "safetensors", shards=2)
    model = load_checkpoint_and_dispatch(empty_model(), checkpoint, DISK_ONLY)
    assert torch.equal(model(sample_ids()), reference)
    folder = tmp_path / "offload"
    load_checkpoint_and_dispatch(empty_model(), checkpoint, DISK_ONLY, offload_folder=folder)
    assert not folder.exists()


def test_pickle_disk_offload_copies_into_the_folder_in_accelerates_format(full, tmp_path):
    checkpoint = save_checkpoint(full, tmp_path / "ckpt", "bin")
    folder = tmp_path / "offload"
    load_checkpoint_and_dispatch(empty_model(), checkpoint, CPU_AND_DISK, offload_folder=folder)
    index = json.loads((folder / "index.json").read_text())
    assert index["blocks.1.up.weight"] == {"dtype": "float32", "shape": [32, 16]}
    assert (folder / "blocks.1.up.weight.dat").stat().st_size == 32 * 16 * 4
    assert "blocks.0.up.weight" not in index  # only what the map sends to disk


def test_pickle_disk_offload_without_a_folder_is_an_error(full, tmp_path):
    checkpoint = save_checkpoint(full, tmp_path / "ckpt", "bin")
    model = empty_model()
    with pytest.raises(ConfigError) as info:
        load_checkpoint_and_dispatch(model, checkpoint, DISK_ONLY)
    assert info.value.key == "offload_folder"
    assert model.blocks[0].up.weight.is_meta  # nothing was loaded


def test_auto_map_on_cpu_only_fills_cpu_then_disk(full, reference, tmp_path):
    checkpoint = save_checkpoint(full, tmp_path / "ckpt", "safetensors", shards=3)
    model = load_checkpoint_and_dispatch(empty_model(), checkpoint, "auto",
                                         max_memory={"cpu": 12_000},
                                         no_split_module_classes=["Block"])
    devices = model.hf_device_map
    assert set(devices.values()) == {"cpu", "disk"}
    assert devices["embed"] == "cpu" and devices["blocks.3"] == "disk"
    assert torch.equal(model(sample_ids()), reference)


def test_tied_head_shares_the_embedding_when_both_are_resident(full, tmp_path):
    checkpoint = save_checkpoint(full, tmp_path / "ckpt", "safetensors")
    model = empty_model()
    load_checkpoint_in_model(model, checkpoint)
    assert model.head.weight is model.embed.weight
    assert torch.equal(model.head.weight, full.embed.weight)


def test_tied_head_on_disk_with_embedding_on_cpu(full, reference, tmp_path):
    checkpoint = save_checkpoint(full, tmp_path / "ckpt", "bin")
    folder = tmp_path / "offload"
    device_map = {"embed": "cpu", "positions": "cpu", "blocks": "cpu", "norm": "cpu",
                  "head": "disk"}
    model = load_checkpoint_and_dispatch(empty_model(), checkpoint, device_map,
                                         offload_folder=folder)
    assert torch.equal(model(sample_ids()), reference)
    assert not folder.exists()  # the head reuses the resident embedding: nothing copied


def test_tied_embedding_on_disk_with_head_on_cpu(full, reference, tmp_path):
    checkpoint = save_checkpoint(full, tmp_path / "ckpt", "safetensors")
    device_map = {"embed": "disk", "positions": "cpu", "blocks": "cpu", "norm": "cpu",
                  "head": "cpu"}
    model = load_checkpoint_and_dispatch(empty_model(), checkpoint, device_map)
    assert torch.equal(model(sample_ids()), reference)


def test_buffers_persistent_and_not(full, reference, tmp_path):
    checkpoint = save_checkpoint(full, tmp_path / "ckpt", "safetensors")
    model = load_checkpoint_and_dispatch(empty_model(), checkpoint, DISK_ONLY,
                                         offload_buffers=True)
    assert model.blocks[0].gate.is_meta  # offloaded with its block
    assert model.positions.is_meta  # in no checkpoint: offloaded from its computed values
    assert torch.equal(model(sample_ids()), reference)
    kept = load_checkpoint_and_dispatch(empty_model(), checkpoint, DISK_ONLY)
    assert torch.equal(kept.blocks[0].gate, full.blocks[0].gate)  # resident by default


def test_dtype_casts_floating_weights(full, tmp_path):
    checkpoint = save_checkpoint(full, tmp_path / "ckpt", "safetensors")
    model = load_checkpoint_and_dispatch(empty_model(), checkpoint, CPU_AND_DISK,
                                         dtype="float64")
    assert model.embed.weight.dtype == torch.float64
    with torch.no_grad():
        assert torch.equal(model(sample_ids()), make_model().double()(sample_ids()))


def test_keep_in_fp32_modules_stay_fp32(full, tmp_path):
    model = empty_model()
    load_checkpoint_in_model(model, save_checkpoint(full, tmp_path / "ckpt"),
                             dtype=torch.float16, keep_in_fp32_modules=["norm"])
    assert model.embed.weight.dtype == torch.float16
    assert model.blocks[0].norm.weight.dtype == torch.float32
    assert model.blocks[0].gate.dtype == torch.float16


def test_load_then_dispatch_in_two_steps_uses_the_offload_index(full, reference, tmp_path):
    checkpoint = save_checkpoint(full, tmp_path / "ckpt", "safetensors", shards=2)
    folder = tmp_path / "offload"
    model = empty_model()
    load_checkpoint_in_model(model, checkpoint, CPU_AND_DISK, offload_folder=folder)
    index = json.loads((folder / "index.json").read_text())
    assert index["blocks.1.up.weight"]["safetensors_file"].endswith(".safetensors")
    assert sorted(os.listdir(folder)) == ["index.json"]  # a pointer, not a copy
    model = dispatch_model(model, CPU_AND_DISK, offload_dir=folder)
    assert torch.equal(model(sample_ids()), reference)


def test_standalone_disk_load_without_folder_is_an_error(full, tmp_path):
    checkpoint = save_checkpoint(full, tmp_path / "ckpt", "safetensors")
    with pytest.raises(ConfigError) as info:
        load_checkpoint_in_model(empty_model(), checkpoint, DISK_ONLY)
    assert info.value.key == "offload_folder"


def test_load_into_a_real_model_with_no_map(full, reference, tmp_path):
    checkpoint = save_checkpoint(full, tmp_path / "ckpt", "bin", shards=2)
    model = TinyLM().eval()
    load_checkpoint_in_model(model, checkpoint)
    assert torch.equal(model(sample_ids()), reference)


def _write(tmp_path, state):
    import safetensors.torch

    path = tmp_path / "bad.safetensors"
    safetensors.torch.save_file(state, str(path))
    return path


def test_missing_keys_are_an_error_and_the_model_is_unchanged(full, tmp_path):
    state = stored_state(full)
    del state["blocks.2.up.weight"]
    model = empty_model()
    with pytest.raises(CheckpointMismatchError) as info:
        load_checkpoint_and_dispatch(model, _write(tmp_path, state), ALL_CPU)
    assert info.value.missing_keys == ("blocks.2.up.weight",)
    assert model.embed.weight.is_meta and not hasattr(model, "hf_device_map")


def test_missing_keys_of_a_real_model_warn_unless_strict(full, tmp_path):
    state = stored_state(full)
    del state["norm.bias"]
    path = _write(tmp_path, state)
    model = TinyLM()
    with pytest.warns(UserWarning, match="norm.bias"):
        load_checkpoint_in_model(model, path)
    with pytest.raises(CheckpointMismatchError) as info:
        load_checkpoint_in_model(TinyLM(), path, strict=True)
    assert info.value.missing_keys == ("norm.bias",)


def test_unexpected_keys_are_logged_or_fail_with_strict(full, tmp_path, caplog):
    state = stored_state(full) | {"extra.weight": torch.ones(2)}
    path = _write(tmp_path, state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # logged, never warned: this filter must not fail it
        load_checkpoint_in_model(empty_model(), path)
    assert "extra.weight" in caplog.text and caplog.records[-1].levelname == "WARNING"
    model = empty_model()
    with pytest.raises(RuntimeError) as info:  # what Accelerate's strict load raises
        load_checkpoint_in_model(model, path, strict=True)
    assert isinstance(info.value, CheckpointMismatchError)
    with pytest.raises(CheckpointMismatchError) as info:
        load_checkpoint_in_model(model, path, strict=True)
    assert info.value.unexpected_keys == ("extra.weight",)
    assert model.embed.weight.is_meta


def test_shape_mismatch_names_the_key_and_both_shapes(full, tmp_path):
    state = stored_state(full) | {"blocks.0.up.weight": torch.zeros(33, 16)}
    model = empty_model()
    with pytest.raises(CheckpointMismatchError) as info:
        load_checkpoint_in_model(model, _write(tmp_path, state))
    assert info.value.mismatched_shapes == {"blocks.0.up.weight": ((33, 16), (32, 16))}
    assert model.embed.weight.is_meta


def test_meta_non_persistent_buffer_is_reported_missing(full, tmp_path):
    from nbaccel.big_modeling import init_empty_weights

    with init_empty_weights(include_buffers=True):
        model = TinyLM()
    with pytest.raises(CheckpointMismatchError) as info:
        load_checkpoint_in_model(model, save_checkpoint(full, tmp_path / "c"))
    assert info.value.missing_keys == ("positions",)


def test_a_map_splitting_a_module_fails_before_any_weight_is_loaded(full, tmp_path):
    split = {"embed": "cpu", "positions": "cpu", "blocks": "cpu", "norm.weight": "cpu",
             "norm.bias": "disk", "head": "cpu"}
    model = empty_model()
    with pytest.raises(DeviceMapError) as info:
        load_checkpoint_and_dispatch(model, save_checkpoint(full, tmp_path / "c"), split)
    assert info.value.key == "norm.bias" and info.value.valid == ["cpu"]
    assert all(p.is_meta for p in model.parameters()) and not hasattr(model, "hf_device_map")


@pytest.mark.parametrize("load", [load_checkpoint_in_model, load_checkpoint_and_dispatch])
@pytest.mark.parametrize("option,value", [("full_state_dict", False),
                                          ("broadcast_from_rank0", True)])
def test_unsupported_distributed_loading_options_are_refused_before_loading(full, tmp_path, load,
                                                                           option, value):
    checkpoint = save_checkpoint(full, tmp_path / "c")
    model = empty_model()
    load(model, checkpoint, ALL_CPU, full_state_dict=True, broadcast_from_rank0=False)
    assert not model.embed.weight.is_meta  # the defaults are accepted
    model = empty_model()
    with pytest.raises(ConfigError) as info:
        load(model, checkpoint, ALL_CPU, **{option: value})
    assert (info.value.key, info.value.value, info.value.valid) == (option, value, [not value])
    assert "not supported" in str(info.value) and model.embed.weight.is_meta


def test_offload_8bit_bnb_is_refused():
    with pytest.raises(ConfigError) as info:
        load_checkpoint_in_model(empty_model(), "unused.safetensors", offload_8bit_bnb=True)
    assert info.value.key == "offload_8bit_bnb"


def test_loading_functions_take_accelerates_arguments_in_its_order():
    accelerate = pytest.importorskip("accelerate")
    from accelerate.utils import load_checkpoint_in_model as theirs_in_model

    for ours, theirs in [(load_checkpoint_in_model, theirs_in_model),
                         (load_checkpoint_and_dispatch, accelerate.load_checkpoint_and_dispatch)]:
        names = list(inspect.signature(theirs).parameters)
        assert list(inspect.signature(ours).parameters)[:len(names)] == names


def test_an_interrupt_part_way_through_a_load_leaves_the_model_as_it_was(full, tmp_path, monkeypatch):
    from nbaccel.big_modeling import loading

    ckpt = save_checkpoint(full, tmp_path, shards=2)
    model = make_model(seed=7)  # a real model with weights of its own, loaded over
    before = dict(model.state_dict(keep_vars=True))
    values = {k: v.detach().clone() for k, v in before.items()}
    real, calls = loading.set_module_tensor_to_device, []

    def interrupted(*args, **kwargs):  # Ctrl-C after 5 tensors
        calls.append(args[1])
        if len(calls) == 6:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(loading, "set_module_tensor_to_device", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_checkpoint_in_model(model, ckpt)
    after = model.state_dict(keep_vars=True)
    assert all(after[k] is before[k] and torch.equal(after[k], values[k]) for k in before)
    assert model.head.weight is model.embed.weight  # the tie too
