"""Fault matrix, round two, checkpoint rows: what is not a checkpoint file is refused before any read.

A FIFO (which would block every load, and Ctrl-C with it), a device or a directory named like a
checkpoint file or shard; a safetensors header nested without end; tensors whose bytes overlap or
leave the data section. Each is a ``CheckpointError`` naming the file, raised before anything is
read from it, and the model (or training state) is exactly as before.
"""

from __future__ import annotations

import functools
import json
import os
import struct
import threading

import pytest
from safetensors.torch import save_file

from nbaccel.big_modeling import load_checkpoint_in_model
from nbaccel.big_modeling.checkpoint_files import SafetensorsFile
from nbaccel.errors import CheckpointError
from tests.faults.helpers import Trainer, assert_same
from tests.training.helpers import TinyMLP


def _returns_without_blocking(call) -> BaseException | None:
    """Run ``call`` in a thread; whatever it raised. A read of a FIFO would never return."""
    outcome: list[BaseException | None] = []

    def target() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout=120)  # generous: the refusal is one stat(); a blocked read never ends
    assert not thread.is_alive(), "the load blocked on a file that is not a regular file"
    return outcome[0]


def _model_refuses(checkpoint, kind: str) -> CheckpointError:
    model = TinyMLP()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    error = _returns_without_blocking(lambda: load_checkpoint_in_model(model, str(checkpoint)))
    assert isinstance(error, CheckpointError), error
    assert f"is not a regular file (it is a {kind})" in str(error) and "Fix:" in str(error)
    assert_same(model.state_dict(), before)
    return error


def test_a_fifo_named_model_safetensors_is_refused_not_waited_on(tmp_path):
    path = tmp_path / "model.safetensors"
    os.mkfifo(path)
    assert _model_refuses(path, "FIFO (named pipe)").path == str(path)


def test_a_device_named_like_a_checkpoint_is_refused(tmp_path):
    path = tmp_path / "model.safetensors"
    path.symlink_to("/dev/zero")
    assert _model_refuses(path, "character device").path == str(path)


def test_a_directory_as_a_shard_is_refused_by_name(tmp_path):
    save_file({k: v for k, v in TinyMLP().state_dict().items() if k.startswith("fc1")},
              tmp_path / "model-1.safetensors")
    (tmp_path / "model-2.safetensors").mkdir()
    weight_map = {k: "model-1.safetensors" if k.startswith("fc1") else "model-2.safetensors"
                  for k in TinyMLP().state_dict()}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert _model_refuses(tmp_path, "directory").path == str(tmp_path / "model-2.safetensors")


def test_a_fifo_in_a_training_state_is_refused_and_changes_nothing(tmp_path):
    trainer = Trainer(seed=0)
    trainer.train(2)
    trainer.accelerator.save_state(tmp_path / "ckpt")
    for name in ("model.safetensors", "optimizer.bin"):
        os.replace(tmp_path / "ckpt" / name, tmp_path / f"{name}.saved")
        os.mkfifo(tmp_path / "ckpt" / name)
        other = Trainer(seed=1)
        before = other.snapshot()
        error = _returns_without_blocking(functools.partial(other.accelerator.load_state, tmp_path / "ckpt"))
        assert isinstance(error, CheckpointError) and error.path == str(tmp_path / "ckpt" / name), error
        assert "FIFO" in str(error)
        assert_same(other.snapshot(), before)
        os.unlink(tmp_path / "ckpt" / name)
        os.replace(tmp_path / f"{name}.saved", tmp_path / "ckpt" / name)
    loaded = Trainer(seed=1)
    loaded.accelerator.load_state(tmp_path / "ckpt")  # put back, it loads: nothing was lost
    assert_same(loaded.snapshot(), trainer.snapshot())


def _write_safetensors(path, header: bytes, data: bytes = b"") -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def _header(entries: dict) -> bytes:
    return json.dumps(entries).encode()


@pytest.mark.parametrize("nesting", [10, 100_000])
def test_a_deeply_nested_header_is_a_checkpoint_error_not_a_recursion_error(tmp_path, nesting):
    path = tmp_path / "model.safetensors"
    _write_safetensors(path, b'{"__metadata__": ' + b"[" * nesting + b"]" * nesting + b"}")
    with pytest.raises(CheckpointError, match="nested deeper than 4 levels") as info:
        load_checkpoint_in_model(TinyMLP(), str(path))
    assert info.value.path == str(path)


W = {"dtype": "F32", "shape": [2]}  # 8 bytes


@pytest.mark.parametrize("entries, message", [
    ({"a": {**W, "data_offsets": [0, 8]}, "b": {**W, "data_offsets": [4, 12]}}, "overlap (data bytes 4..8"),
    ({"a": {**W, "data_offsets": [0, 8]}, "b": {**W, "data_offsets": [0, 8]}}, "overlap (data bytes 0..8"),
    ({"a": {**W, "data_offsets": [-8, 0]}}, "outside the data section"),
    ({"a": {**W, "data_offsets": [12, 4]}}, "outside the data section"),
    ({"a": {**W, "data_offsets": [16, 24]}}, "the file is truncated"),
])
def test_overlapping_or_out_of_range_offsets_are_refused(tmp_path, entries, message):
    path = tmp_path / "model.safetensors"
    _write_safetensors(path, _header(entries), bytes(16))
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(")) as info:
        SafetensorsFile(path)
    assert info.value.path == str(path)
