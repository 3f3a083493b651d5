"""safe_load: what a training-state file may hold, and the errors for everything else."""

from __future__ import annotations

import pytest
import torch

import nbaccel
from nbaccel.config import load_config
from nbaccel.safe_load import load_state_file
from nbaccel.training.plugins import ProjectConfiguration
from nbaccel.training.prepared import PreparedObjects
from nbaccel.training.training_state import CheckpointContext, save_accelerator_state
from tests.training.helpers import TinyMLP


def test_plain_values_and_numpy_arrays_load_and_the_opt_in_is_passed_on(tmp_path):
    import numpy as np

    path = tmp_path / "state.pkl"
    torch.save({"t": torch.ones(2), "n": np.arange(3, dtype=np.uint32), "s": "x", "l": [1, 2.0, None]}, path)
    state = load_state_file(path)
    assert torch.equal(state["t"], torch.ones(2)) and state["n"].tolist() == [0, 1, 2] and state["l"] == [1, 2.0, None]
    assert load_state_file(path, {"weights_only": False})["s"] == "x"


def test_a_pickle_torch_cannot_read_weights_only_is_refused_with_the_reason(tmp_path):
    path = tmp_path / "optimizer.bin"
    path.write_bytes(b"\x80\x02garbage")
    with pytest.raises(nbaccel.UnsafeCheckpointError, match="stopped at: Unsupported operand"):
        load_state_file(path)
    with pytest.raises(nbaccel.CheckpointError, match="pickle data was truncated") as info:
        load_state_file(path, {"weights_only": False})
    assert not isinstance(info.value, nbaccel.UnsafeCheckpointError) and info.value.path == str(path)


def test_an_empty_file_is_a_checkpoint_error_naming_it(tmp_path):
    path = tmp_path / "scheduler.bin"
    path.write_bytes(b"")
    with pytest.raises(nbaccel.CheckpointError, match="truncated or corrupt") as info:
        load_state_file(path)
    assert info.value.path == str(path)


def _saved(tmp_path) -> tuple[PreparedObjects, CheckpointContext]:
    prepared = PreparedObjects()
    model = TinyMLP()
    prepared.add("model", model)
    prepared.add("optimizer", torch.optim.SGD(model.parameters(), lr=0.1))
    context = CheckpointContext(process=nbaccel.ProcessState(), project=ProjectConfiguration())
    save_accelerator_state(prepared, context, tmp_path / "ckpt", safe_serialization=False)
    return prepared, context


def test_a_model_file_that_is_not_a_state_dict_is_refused(tmp_path):
    from nbaccel.training.state_loading import load_accelerator_state

    prepared, context = _saved(tmp_path)
    torch.save([torch.ones(1)], tmp_path / "ckpt" / "pytorch_model.bin")
    with pytest.raises(nbaccel.CheckpointError, match="holds a list, not a state dict"):
        load_accelerator_state(prepared, context, tmp_path / "ckpt")


def test_an_optimizer_file_without_optimizer_state_is_refused(tmp_path):
    from nbaccel.training.state_loading import load_accelerator_state

    prepared, context = _saved(tmp_path)
    torch.save({"lr": 0.1}, tmp_path / "ckpt" / "optimizer.bin")
    with pytest.raises(nbaccel.CheckpointError, match="holds no optimizer state") as info:
        load_accelerator_state(prepared, context, tmp_path / "ckpt")
    assert info.value.path == str(tmp_path / "ckpt" / "optimizer.bin")


def test_a_config_path_that_is_a_folder_is_a_config_error(tmp_path):
    with pytest.raises(nbaccel.ConfigError, match=r"is not a regular file \(it is a directory\)") as info:
        load_config(tmp_path)
    assert info.value.key == "config_file"


def test_a_config_file_that_cannot_be_opened_is_a_config_error(tmp_path, monkeypatch):
    import os

    path = tmp_path / "c.yaml"
    path.write_text("num_processes: 2\n")

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")  # what a non-root user gets for a 000 file

    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(nbaccel.ConfigError, match=r"cannot read the config file .*: Permission denied") as info:
        load_config(path)
    assert info.value.key == "config_file"
