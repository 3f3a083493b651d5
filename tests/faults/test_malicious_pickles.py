"""Fault matrix, security rows: a hostile file in a checkpoint folder never runs code by default.

Every file ``load_state`` reads is replaced, in turn, by a pickle whose loading would create a
marker file. ``load_state`` must refuse it (UnsafeCheckpointError naming the file and the opt-in),
the marker must never appear, and the model, optimizer, scheduler and registered objects must be
unchanged. With the explicit opt-in the same file does run, which shows the marker would catch it.
"""

from __future__ import annotations

import re

import pytest
import torch

import nbaccel
from nbaccel.safe_load import load_state_file
from tests.faults.helpers import Trainer, assert_same, plant

EVERY_FILE = ["optimizer.bin", "scheduler.bin", "sampler.bin", "scaler.pt", "random_states_0.pkl",
              "custom_checkpoint_0.pkl", "pytorch_model.bin"]


@pytest.fixture
def saved(tmp_path):
    trainer = Trainer(seed=0)
    trainer.train(2)
    trainer.accelerator.save_state(tmp_path / "ckpt", safe_serialization=False)
    return tmp_path / "ckpt"


def test_save_state_writes_every_file_the_matrix_attacks_and_all_load_weights_only(saved):
    for name in EVERY_FILE:
        assert (saved / name).is_file(), name
        torch.load(saved / name, map_location="cpu", weights_only=True)  # no allowlist needed: plain values


@pytest.mark.parametrize("name", EVERY_FILE)
def test_a_malicious_pickle_in_any_file_is_refused_and_runs_nothing(saved, tmp_path, name):
    marker = tmp_path / "pwned"
    plant(saved / name, marker)
    trainer = Trainer(seed=1)
    before = trainer.snapshot()
    with pytest.raises(nbaccel.UnsafeCheckpointError) as info:
        trainer.accelerator.load_state(saved)
    assert not marker.exists()
    assert info.value.path == str(saved / name)
    assert name in str(info.value) and 'load_kwargs={"weights_only": False}' in str(info.value)
    assert "it names exec" in str(info.value)
    assert_same(trainer.snapshot(), before)  # nothing was loaded, not even the files read before this one


def test_the_opt_in_loads_a_trusted_pickle_and_so_would_run_the_hostile_one(saved, tmp_path):
    marker = tmp_path / "pwned"
    plant(saved / "custom_checkpoint_0.pkl", marker)
    assert load_state_file(saved / "custom_checkpoint_0.pkl", {"weights_only": False}) == {"state": None}
    assert marker.read_text() == "ran"


def test_the_opt_in_through_load_state_loads_a_checkpoint_with_an_arbitrary_object(tmp_path):
    trainer = Trainer(seed=0)
    trainer.counter.count = 7
    trainer.accelerator.save_state(tmp_path / "ckpt")
    torch.save({"count": 7, "when": __import__("datetime").date(2026, 12, 3)}, tmp_path / "ckpt" /
               "custom_checkpoint_0.pkl")  # a user object whose state_dict holds a date
    fresh = Trainer(seed=1)
    with pytest.raises(nbaccel.UnsafeCheckpointError, match=re.escape("datetime.date")):
        fresh.accelerator.load_state(tmp_path / "ckpt")
    assert fresh.counter.count == 0
    fresh.accelerator.load_state(tmp_path / "ckpt", load_kwargs={"weights_only": False})
    assert fresh.counter.count == 7


def test_saving_an_object_whose_state_would_be_refused_warns_at_save_time(tmp_path):
    class Dated:
        def state_dict(self) -> dict:
            return {"when": __import__("datetime").date(2026, 12, 3)}

        def load_state_dict(self, state: dict) -> None:
            pass

    trainer = Trainer(seed=0)
    trainer.accelerator.register_for_checkpointing(Dated())
    with pytest.warns(UserWarning, match="load_state will refuse custom_checkpoint_1.pkl"):
        trainer.accelerator.save_state(tmp_path / "ckpt")


def test_rng_states_written_by_accelerate_with_numpy_arrays_still_load(saved):
    import numpy as np

    state = torch.load(saved / "random_states_0.pkl", weights_only=True)
    state["numpy_random_seed"] = np.random.get_state()  # what Accelerate (and older nbaccel) writes
    torch.save(state, saved / "random_states_0.pkl")
    trainer = Trainer(seed=1)
    trainer.accelerator.load_state(saved)
    assert trainer.counter.count == 2
