"""save_state / load_state resume exactly and atomically; save_model shards like Accelerate."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

import nbaccel
from nbaccel.training.checkpointing import MARKER
from tests.training.helpers import (
    DropoutMLP,
    TiedLM,
    TinyMLP,
    flat_weights,
    launch,
    model_and_optimizer,
    regression_data,
)


class Counter:
    """A user object registered for checkpointing."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


def _one_step(accelerator, model, optimizer, scheduler, x, y, counter) -> float:
    with accelerator.accumulate(model):
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    counter.count += 1
    return loss.item()


def _run(folder: str, resume: bool, mixed_precision: str = "no") -> dict:
    accelerator = nbaccel.Accelerator(gradient_accumulation_steps=2, mixed_precision=mixed_precision)
    nbaccel.set_seed(0)
    model, optimizer = model_and_optimizer(kind=DropoutMLP)
    model.train()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    loader = DataLoader(regression_data(64), batch_size=4, shuffle=True)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    losses: list[float] = []
    if resume:
        accelerator.load_state(folder)
        first = accelerator.skip_first_batches(loader, 4)
    else:
        first = loader
    for step, (x, y) in enumerate(first):
        if not resume and step == 4:  # at an optimizer-step boundary (accumulation 2)
            accelerator.save_state(folder)
            losses = []
        losses.append(_one_step(accelerator, model, optimizer, scheduler, x, y, counter))
    for x, y in loader:  # the next epoch: a new order, the same in both runs
        losses.append(_one_step(accelerator, model, optimizer, scheduler, x, y, counter))
    return {"losses": losses, "weights": flat_weights(accelerator.unwrap_model(model)), "count": counter.count,
            "lr": scheduler.get_last_lr()}


def test_resumed_run_reproduces_the_original_losses_exactly_single_process(tmp_path):
    original = _run(str(tmp_path / "ckpt"), resume=False)
    resumed = _run(str(tmp_path / "ckpt"), resume=True)
    assert resumed["losses"] == original["losses"]
    assert torch.equal(resumed["weights"], original["weights"])
    assert resumed["count"] == original["count"] and resumed["lr"] == original["lr"]
    assert sorted(os.listdir(tmp_path / "ckpt")) == sorted([
        MARKER, "custom_checkpoint_0.pkl", "model.safetensors", "optimizer.bin", "random_states_0.pkl",
        "sampler.bin", "scheduler.bin"])


def test_resumed_run_reproduces_the_original_losses_exactly_on_two_processes(tmp_path):
    folder = str(tmp_path / "ckpt")
    original = launch(_run, 2, folder, False)
    resumed = launch(_run, 2, folder, True)
    for rank in (0, 1):
        assert resumed[rank]["losses"] == original[rank]["losses"]
        assert torch.equal(resumed[rank]["weights"], original[rank]["weights"])
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= set(os.listdir(folder))


def test_resume_with_fp16_restores_the_grad_scaler(tmp_path):
    original = _run(str(tmp_path / "ckpt"), resume=False, mixed_precision="fp16")
    assert (tmp_path / "ckpt" / "scaler.pt").exists()
    resumed = _run(str(tmp_path / "ckpt"), resume=True, mixed_precision="fp16")
    assert resumed["losses"] == original["losses"]


class KillOnSave(Counter):
    """Kills its own process the second time it is saved."""

    def __init__(self) -> None:
        super().__init__()
        self.saves = 0

    def state_dict(self) -> dict:
        self.saves += 1
        if self.saves == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().state_dict()


def _save_twice(folder: str) -> None:
    accelerator = nbaccel.Accelerator()
    model, optimizer = model_and_optimizer()
    model, optimizer = accelerator.prepare(model, optimizer)
    killer = KillOnSave()
    accelerator.register_for_checkpointing(killer)
    killer.count = 1
    accelerator.save_state(folder)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    killer.count = 2
    accelerator.save_state(folder)  # rank 0 dies in the middle of this one


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_intact(tmp_path):
    folder = tmp_path / "ckpt"
    # the launch fails (rank 0 killed; rank 1 may report the broken gloo connection first)
    with pytest.raises(RuntimeError):
        launch(_save_twice, 2, str(folder))
    assert (folder / MARKER).is_file()
    # the previous checkpoint is whole and loads
    accelerator = nbaccel.Accelerator()
    model, optimizer = model_and_optimizer()
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.load_state(str(folder))
    assert counter.count == 1
    reference, _ = model_and_optimizer()
    assert torch.equal(flat_weights(model), flat_weights(reference))  # not the +1 weights


def test_a_crash_between_the_renames_still_finds_the_previous_checkpoint(tmp_path):
    accelerator = nbaccel.Accelerator()
    _model, _optimizer = accelerator.prepare(*model_and_optimizer())
    accelerator.save_state(tmp_path / "ckpt")
    os.rename(tmp_path / "ckpt", tmp_path / ".ckpt.nbaccel-old")  # as if killed right after the first rename
    assert accelerator.load_state(tmp_path / "ckpt") == str(tmp_path / ".ckpt.nbaccel-old")


def test_loading_an_incomplete_or_missing_checkpoint_is_a_checkpoint_error(tmp_path):
    accelerator = nbaccel.Accelerator()
    _model, _optimizer = accelerator.prepare(*model_and_optimizer())
    with pytest.raises(nbaccel.CheckpointError) as info:
        accelerator.load_state(tmp_path / "nothing")
    assert info.value.path == str(tmp_path / "nothing")
    accelerator.save_state(tmp_path / "ckpt")
    os.remove(tmp_path / "ckpt" / "optimizer.bin")
    with pytest.raises(nbaccel.CheckpointError, match=re.escape("optimizer.bin")):
        accelerator.load_state(tmp_path / "ckpt")


def test_loading_into_a_different_model_is_a_mismatch_error(tmp_path):
    accelerator = nbaccel.Accelerator()
    accelerator.prepare(*model_and_optimizer())
    accelerator.save_state(tmp_path / "ckpt")
    other = nbaccel.Accelerator()
    torch.manual_seed(0)
    other.prepare(TiedLM())
    with pytest.raises(nbaccel.CheckpointMismatchError) as info:
        other.load_state(tmp_path / "ckpt")
    assert "embed.weight" in info.value.missing_keys and "fc1.weight" in info.value.unexpected_keys
    other.load_state(tmp_path / "ckpt", strict=False)  # strict=False loads what fits


def test_automatic_checkpoint_naming_keeps_total_limit(tmp_path):
    config = nbaccel.ProjectConfiguration(str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    accelerator = nbaccel.Accelerator(project_config=config)
    _model, _optimizer = accelerator.prepare(*model_and_optimizer())
    for _ in range(3):
        accelerator.save_state()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_1", "checkpoint_2"]
    again = nbaccel.Accelerator(project_dir=str(tmp_path), project_config=nbaccel.ProjectConfiguration(
        automatic_checkpoint_naming=True))
    again.prepare(*model_and_optimizer())
    assert again.load_state().endswith("checkpoint_2") and again.save_iteration == 3


def test_total_limit_without_a_project_dir_saves_into_the_folder_given(tmp_path):
    """Nothing to prune without a project_dir: the save into a named folder no longer ends in a TypeError."""
    config = nbaccel.ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=1)
    accelerator = nbaccel.Accelerator(project_config=config)
    accelerator.prepare(*model_and_optimizer())
    assert accelerator.save_state(str(tmp_path / "a")) == str(tmp_path / "a") and (tmp_path / "a").is_dir()


def test_automatic_naming_never_overwrites_an_existing_checkpoint(tmp_path):
    config = nbaccel.ProjectConfiguration(str(tmp_path), automatic_checkpoint_naming=True)
    accelerator = nbaccel.Accelerator(project_config=config)
    model, _optimizer = accelerator.prepare(*model_and_optimizer())
    first = accelerator.save_state()
    assert first == str(tmp_path / "checkpoints" / "checkpoint_0") and accelerator.save_iteration == 1
    before = (tmp_path / "checkpoints" / "checkpoint_0" / "model.safetensors").read_bytes()
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    accelerator.project_configuration.iteration = 0
    with pytest.raises(nbaccel.CheckpointError, match="exists already") as info:
        accelerator.save_state()
    assert info.value.path == first and "project_configuration.iteration" in str(info.value)
    assert (tmp_path / "checkpoints" / "checkpoint_0" / "model.safetensors").read_bytes() == before


def _save_on_two(folder: str) -> torch.Tensor:
    accelerator = nbaccel.Accelerator()
    model, _optimizer = accelerator.prepare(*model_and_optimizer(seed=3))
    accelerator.save_state(folder)
    return flat_weights(model)


def test_loading_with_another_process_count_works_like_accelerate_and_says_what_it_loses(tmp_path):
    saved = launch(_save_on_two, 2, str(tmp_path / "ckpt"))[0]
    accelerator = nbaccel.Accelerator()
    model, _optimizer = accelerator.prepare(*model_and_optimizer(seed=4))
    with pytest.warns(UserWarning, match="saved by 2 processes and is loaded by 1") as record:
        accelerator.load_state(tmp_path / "ckpt")
    assert "load it with 2 processes" in str(record[0].message)
    assert torch.equal(flat_weights(model), saved)


def test_save_state_without_a_folder_or_checkpoints_is_an_error(tmp_path):
    accelerator = nbaccel.Accelerator()
    with pytest.raises(nbaccel.ConfigError, match="need a folder"):
        accelerator.save_state()
    auto = nbaccel.Accelerator(project_config=nbaccel.ProjectConfiguration(str(tmp_path),
                                                                           automatic_checkpoint_naming=True))
    with pytest.raises(nbaccel.CheckpointError, match="no automatic checkpoint"):
        auto.load_state()


def test_register_for_checkpointing_rejects_objects_without_state_dict():
    accelerator = nbaccel.Accelerator()
    with pytest.raises(nbaccel.ConfigError) as info:
        accelerator.register_for_checkpointing(Counter(), object())
    assert info.value.value == ["item 1 (object)"]


# --------------------------------------------------------------------------- save_model


def test_save_model_shards_with_an_index_like_accelerate(tmp_path):
    accelerator = nbaccel.Accelerator()
    torch.manual_seed(0)
    model = accelerator.prepare(TinyMLP())
    (tmp_path / "model.safetensors").write_text("stale single file from an earlier save")
    accelerator.save_model(model, tmp_path, max_shard_size=100)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    # fc1.weight (128 bytes) is over the limit alone; the other three (68 bytes) share a shard
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert [k for k, f in index["weight_map"].items() if f == files[0]] == ["fc1.weight"]
    assert index["metadata"]["total_size"] == sum(p.numel() * 4 for p in model.parameters())
    assert sorted(index["weight_map"]) == sorted(model.state_dict())
    assert not (tmp_path / "model.safetensors").exists()  # the stale file is gone
    merged = {k: v for f in files for k, v in load_file(str(tmp_path / f)).items()}
    for name, tensor in model.state_dict().items():
        assert torch.equal(merged[name], tensor)
    accelerator.save_model(model, tmp_path)  # one shard again: no index left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_save_model_with_tied_weights_and_torch_format(tmp_path):
    accelerator = nbaccel.Accelerator()
    model = accelerator.prepare(TiedLM())
    accelerator.save_model(model, tmp_path / "safe")
    assert list(load_file(str(tmp_path / "safe" / "model.safetensors"))) == ["embed.weight"]
    accelerator.save_model(model, tmp_path / "bin", safe_serialization=False)
    assert set(torch.load(tmp_path / "bin" / "pytorch_model.bin")) == {"embed.weight", "head.weight"}
    # a tied model's checkpoint loads back although the alias was not stored
    accelerator.save_state(tmp_path / "state")
    accelerator.load_state(tmp_path / "state")


def test_save_model_errors(tmp_path):
    accelerator = nbaccel.Accelerator()
    model = accelerator.prepare(TinyMLP())
    (tmp_path / "file").write_text("x")
    with pytest.raises(nbaccel.ConfigError, match="is a file"):
        accelerator.save_model(model, tmp_path / "file")
    with pytest.raises(nbaccel.ConfigError) as info:
        accelerator.save_model(model, tmp_path / "m", max_shard_size="ten gigs")
    assert info.value.key == "max_shard_size"


def test_save_writes_once_and_loads(tmp_path):
    accelerator = nbaccel.Accelerator()
    accelerator.save({"a": torch.ones(1)}, tmp_path / "obj.pt")
    assert torch.load(tmp_path / "obj.pt")["a"].item() == 1.0
    accelerator.save({"a": torch.ones(1)}, tmp_path / "obj.safetensors", safe_serialization=True)
    assert load_file(str(tmp_path / "obj.safetensors"))["a"].item() == 1.0
