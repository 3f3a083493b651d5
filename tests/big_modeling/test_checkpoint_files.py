"""Reading checkpoint files: every way a file can be bad gives a clear error naming it."""

from __future__ import annotations

import json
import os
import pickle
import zipfile

import pytest
import safetensors.torch
import torch

from nbaccel.big_modeling import load_checkpoint_and_dispatch, open_checkpoint
from nbaccel.big_modeling.checkpoint_files import (
    SafetensorsFile,
    TensorInfo,
    load_pickle_checkpoint,
    read_tensor,
)
from nbaccel.errors import CheckpointError, UnsafeCheckpointError
from tests.big_modeling.helpers import empty_model, make_model, save_checkpoint


@pytest.fixture
def good(tmp_path):
    return save_checkpoint(make_model(), tmp_path / "ckpt", "safetensors")


def _assert_untouched(model):
    assert model.embed.weight.is_meta and model.blocks[0].up.weight.is_meta


def test_all_dtypes_round_trip(tmp_path):
    state = {str(d): (torch.arange(6) % 2).to(d).reshape(2, 3) for d in
             (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
              torch.int8, torch.uint8, torch.bool)}
    state["scalar"] = torch.tensor(3.5)
    state["empty"] = torch.zeros(0, 4)
    path = tmp_path / "all.safetensors"
    safetensors.torch.save_file(state, str(path))
    ckpt = open_checkpoint(path)
    for key, value in state.items():
        assert ckpt.dtype(key) == value.dtype and torch.equal(ckpt.read(key), value)


def test_truncated_safetensors_is_found_before_anything_loads(good):
    data = good.read_bytes()
    good.write_bytes(data[: len(data) - 100])
    model = empty_model()
    with pytest.raises(CheckpointError, match="truncated") as info:
        load_checkpoint_and_dispatch(model, good, {"": "cpu"})
    assert info.value.path == str(good) and info.value.key is not None
    _assert_untouched(model)


@pytest.mark.parametrize("content,why", [
    (b"\x01\x02", "truncated"),
    ((10**6).to_bytes(8, "little") + b"{}", "truncated"),
    ((200 * 2**20).to_bytes(8, "little") + b"{}", "truncated"),
    ((5).to_bytes(8, "little") + b"{not}", "not valid JSON"),
    ((2).to_bytes(8, "little") + b"[]", "not a JSON object"),
    ((2).to_bytes(8, "little") + b"\xff\xfe", "not valid JSON"),
])
def test_corrupt_safetensors_headers(tmp_path, content, why):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=why) as info:
        SafetensorsFile(path)
    assert info.value.path == str(path)


@pytest.mark.parametrize("entry,why", [
    ({"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}, "malformed"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}, "does not match its shape"),
    ({"dtype": "F32", "data_offsets": [0, 4]}, "malformed"),
])
def test_malformed_header_entries(tmp_path, entry, why):
    header = json.dumps({"w": entry}).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    with pytest.raises(CheckpointError, match=why) as info:
        SafetensorsFile(path)
    assert info.value.key == "w"


def test_file_shrinking_after_its_header_was_read(tmp_path):
    path = tmp_path / "w.bin"
    path.write_bytes(b"\0" * 8)
    with pytest.raises(CheckpointError, match="truncated"):
        read_tensor(TensorInfo(str(path), 0, 16, torch.float32, (4,)))


def test_missing_paths_and_unknown_kinds(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        open_checkpoint(tmp_path / "nope.safetensors")
    with pytest.raises(CheckpointError, match="does not exist"):
        SafetensorsFile(tmp_path / "nope.safetensors")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_pickle_checkpoint(tmp_path / "nope.bin")
    (tmp_path / "weights.npz").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="cannot tell what kind"):
        open_checkpoint(tmp_path / "weights.npz")


def test_folders(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        open_checkpoint(empty)
    many = tmp_path / "many"
    many.mkdir()
    for name in ("a.safetensors", "b.safetensors"):
        safetensors.torch.save_file({"w": torch.ones(1)}, str(many / name))
    with pytest.raises(CheckpointError, match="several weight files"):
        open_checkpoint(many)
    for name in ("a.index.json", "b.index.json"):
        (many / name).write_text("{}")
    with pytest.raises(CheckpointError, match="several checkpoint indexes"):
        open_checkpoint(many)


def test_bad_indexes(tmp_path):
    index = save_checkpoint(make_model(), tmp_path / "ckpt", "safetensors", shards=2)
    original = json.loads(index.read_text())
    index.write_text("{oops")
    with pytest.raises(CheckpointError, match="not a checkpoint index"):
        open_checkpoint(index)
    index.write_text(json.dumps({"weight_map": ["a"]}))
    with pytest.raises(CheckpointError, match="not a checkpoint index"):
        open_checkpoint(index)
    with pytest.raises(CheckpointError, match="does not exist"):
        open_checkpoint(tmp_path / "ckpt" / "other.index.json")
    shards = sorted(set(original["weight_map"].values()))
    wrong = dict(original["weight_map"], **{"embed.weight": shards[1]})
    index.write_text(json.dumps({"weight_map": wrong}))
    with pytest.raises(CheckpointError, match="out of step") as info:
        open_checkpoint(index)
    assert info.value.key == "embed.weight"
    os.remove(tmp_path / "ckpt" / shards[0])
    index.write_text(json.dumps(original))
    with pytest.raises(CheckpointError, match="does not exist") as info:
        open_checkpoint(index)
    assert info.value.path.endswith(shards[0])


class _RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("zipped", [True, False], ids=["torch-zip", "raw-pickle"])
def test_malicious_pickle_is_refused_and_never_runs(tmp_path, zipped):
    marker = tmp_path / "pwned"
    path = tmp_path / "pytorch_model.bin"
    payload = {"embed.weight": _RunsCode(str(marker))}
    if zipped:
        torch.save(payload, path)
    else:
        path.write_bytes(pickle.dumps(payload))
    model = empty_model()
    with pytest.raises(UnsafeCheckpointError, match="would run code") as info:
        load_checkpoint_and_dispatch(model, path, {"": "cpu"})
    assert info.value.path == str(path)
    assert not marker.exists()
    _assert_untouched(model)
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(_RunsCode(str(control))))  # the payload is real: plain pickle runs it
    assert control.exists()


def test_pickles_that_are_not_state_dicts(tmp_path):
    path = tmp_path / "x.pt"
    torch.save([torch.ones(1)], path)
    with pytest.raises(CheckpointError, match="not a flat state dict"):
        load_pickle_checkpoint(path)


@pytest.mark.parametrize("content", [b"garbage that is not a pickle", b""])
def test_corrupt_pickles(tmp_path, content):
    path = tmp_path / "x.bin"
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as info:
        load_pickle_checkpoint(path)
    assert info.value.path == str(path)


def test_truncated_torch_zip(tmp_path):
    path = tmp_path / "x.bin"
    torch.save({"w": torch.ones(1000)}, path)
    assert zipfile.is_zipfile(path)
    path.write_bytes(path.read_bytes()[:500])
    with pytest.raises(CheckpointError, match="cannot read"):
        load_pickle_checkpoint(path)


def test_legacy_pickle_format_loads(tmp_path):
    path = tmp_path / "legacy.pt"
    torch.save({"w": torch.arange(3.0)}, path, _use_new_zipfile_serialization=False)
    assert torch.equal(load_pickle_checkpoint(path)["w"], torch.arange(3.0))


def test_a_mapped_offload_read_is_the_files_bytes_and_writing_it_leaves_the_file_alone(tmp_path):
    from nbaccel.big_modeling.checkpoint_files import map_tensor

    path = tmp_path / "w.safetensors"
    safetensors.torch.save_file({"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(5, dtype=torch.float16)}, path)
    infos = SafetensorsFile(str(path)).tensors
    a, b = map_tensor(infos["a"]), map_tensor(infos["b"])
    assert torch.equal(a, torch.arange(6.0).reshape(2, 3)) and torch.equal(b, torch.ones(5, dtype=torch.float16))
    a.zero_()  # copy-on-write: the tensor changes, the checkpoint does not
    assert torch.equal(safetensors.torch.load_file(path)["a"], torch.arange(6.0).reshape(2, 3))


def test_a_mapped_offload_read_of_a_file_cut_short_names_the_file(tmp_path):
    from nbaccel.big_modeling.checkpoint_files import map_tensor

    path = tmp_path / "w.safetensors"
    safetensors.torch.save_file({"a": torch.ones(1024)}, path)
    info = SafetensorsFile(str(path)).tensors["a"]
    with open(path, "r+b") as handle:  # cut after the header was read: the file shrank under us
        handle.truncate(info.offset + 100)
    with pytest.raises(CheckpointError) as caught:
        map_tensor(info)
    assert caught.value.path == str(path) and "truncated" in str(caught.value)


def test_a_kernel_without_populate_read_still_maps_the_right_bytes(tmp_path, monkeypatch):
    from nbaccel.big_modeling import checkpoint_files
    from nbaccel.big_modeling.checkpoint_files import map_tensor

    monkeypatch.setattr(checkpoint_files, "_MADV_POPULATE_READ", 0x7FFF)  # advice the kernel refuses (EINVAL)
    path = tmp_path / "w.safetensors"
    safetensors.torch.save_file({"a": torch.arange(4096.0)}, path)
    assert torch.equal(map_tensor(SafetensorsFile(str(path)).tensors["a"]), torch.arange(4096.0))
