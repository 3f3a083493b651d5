"""Fault matrix, damaged-checkpoint rows: ``load_state`` checks every file before changing anything.

For each damage (a shape that does not fit, a truncated safetensors file, a missing key, a
truncated optimizer file, an optimizer over other parameters) the error names the file (and the
key), and the model, optimizer, scheduler and registered objects are exactly as before.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

import nbaccel
from tests.faults.helpers import Trainer, assert_same
from tests.training.helpers import TinyMLP


@pytest.fixture
def saved(tmp_path):
    trainer = Trainer(seed=0)
    trainer.train(2)
    trainer.accelerator.save_state(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _refused(folder, error: type[Exception]) -> Exception:
    trainer = Trainer(seed=1)
    before = trainer.snapshot()
    with pytest.raises(error) as info:
        trainer.accelerator.load_state(folder)
    assert_same(trainer.snapshot(), before)
    return info.value


def test_a_shape_mismatch_names_the_file_and_key_and_changes_nothing(saved):
    weights = load_file(saved / "model.safetensors")
    weights["fc2.weight"] = torch.zeros(1, 9)
    save_file(weights, saved / "model.safetensors")
    error = _refused(saved, nbaccel.CheckpointMismatchError)
    assert error.path == str(saved / "model.safetensors")
    assert error.mismatched_shapes == {"fc2.weight": ((1, 9), (1, 8))}
    assert "fc2.weight: (1, 9) in the file, (1, 8) in the model" in str(error)


def test_a_missing_key_names_the_file_and_key_and_changes_nothing(saved):
    weights = load_file(saved / "model.safetensors")
    del weights["fc1.bias"]
    save_file(weights, saved / "model.safetensors")
    error = _refused(saved, nbaccel.CheckpointMismatchError)
    assert error.missing_keys == ("fc1.bias",) and error.path == str(saved / "model.safetensors")


def test_a_truncated_safetensors_file_names_the_file_and_changes_nothing(saved):
    data = (saved / "model.safetensors").read_bytes()
    (saved / "model.safetensors").write_bytes(data[: len(data) - 20])
    error = _refused(saved, nbaccel.CheckpointError)
    assert error.path == str(saved / "model.safetensors") and "truncated or corrupt" in str(error)


def test_a_truncated_optimizer_file_is_found_before_the_model_is_loaded(saved):
    data = (saved / "optimizer.bin").read_bytes()
    (saved / "optimizer.bin").write_bytes(data[: len(data) // 2])
    error = _refused(saved, nbaccel.CheckpointError)
    assert error.path == str(saved / "optimizer.bin")


def test_an_optimizer_over_other_parameters_is_refused_before_the_model_is_loaded(saved):
    state = torch.load(saved / "optimizer.bin", weights_only=True)
    state["param_groups"][0]["params"] = state["param_groups"][0]["params"][:2]
    torch.save(state, saved / "optimizer.bin")
    error = _refused(saved, nbaccel.CheckpointMismatchError)
    assert error.path == str(saved / "optimizer.bin") and "sizes [2]" in str(error)


def test_a_missing_registered_object_file_is_found_before_the_model_is_loaded(saved):
    (saved / "custom_checkpoint_0.pkl").unlink()
    error = _refused(saved, nbaccel.CheckpointError)
    assert error.path == str(saved / "custom_checkpoint_0.pkl")


def test_after_a_refused_load_the_intact_checkpoint_still_loads(saved, tmp_path):
    good = tmp_path / "good"
    trainer = Trainer(seed=0)
    trainer.train(2)
    trainer.accelerator.save_state(good)
    weights = load_file(saved / "model.safetensors")
    weights["fc2.weight"] = torch.zeros(1, 9)
    save_file(weights, saved / "model.safetensors")
    fresh = Trainer(seed=1)
    with pytest.raises(nbaccel.CheckpointMismatchError):
        fresh.accelerator.load_state(saved)
    fresh.accelerator.load_state(good)
    assert_same(fresh.snapshot()["model"], trainer.snapshot()["model"])
    assert fresh.counter.count == 2


def test_strict_false_still_refuses_shapes_but_loads_what_fits(saved):
    weights = load_file(saved / "model.safetensors")
    del weights["fc1.bias"]
    save_file(weights, saved / "model.safetensors")
    trainer = Trainer(seed=1)
    trainer.accelerator.load_state(saved, strict=False)
    assert torch.equal(trainer.accelerator.unwrap_model(trainer.model).fc1.weight, weights["fc1.weight"])
    assert isinstance(trainer.accelerator.unwrap_model(trainer.model), TinyMLP)


def _fsdp_refused_load(folder: str) -> dict:
    from tests.training.helpers import BlockStack, model_and_optimizer

    accelerator = nbaccel.Accelerator(fsdp_plugin=nbaccel.FullyShardedDataParallelPlugin())
    model, _optimizer = accelerator.prepare(*model_and_optimizer(kind=BlockStack, momentum=0.9))
    accelerator.save_state(folder)
    if accelerator.is_main_process:
        weights = load_file(f"{folder}/model.safetensors")
        name = sorted(weights)[0]
        weights[name] = torch.zeros(*weights[name].shape, 2)
        save_file(weights, f"{folder}/model.safetensors")
    accelerator.wait_for_everyone()
    before = accelerator.get_state_dict(model)
    try:
        accelerator.load_state(folder)
    except nbaccel.CheckpointMismatchError as exc:
        error = (exc.path, sorted(exc.mismatched_shapes))
    after = accelerator.get_state_dict(model)
    return {"error": error, "unchanged": all(torch.equal(before[k], after[k]) for k in before)}


def test_an_fsdp_model_refuses_a_shape_mismatch_on_every_rank_unchanged(tmp_path):
    from tests.training.helpers import launch

    results = launch(_fsdp_refused_load, 2, str(tmp_path / "ckpt"))
    for rank in (0, 1):
        path, names = results[rank]["error"]
        assert path == str(tmp_path / "ckpt" / "model.safetensors") and len(names) == 1
        assert results[rank]["unchanged"]
