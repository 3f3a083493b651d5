"""The "Loading checkpoint shards" bar: shown for checkpoints of several files, off on request."""

from __future__ import annotations

import pytest
import torch

from nbaccel.big_modeling import (
    load_checkpoint_and_dispatch,
    load_checkpoint_in_model,
    load_progress,
)
from nbaccel.big_modeling.load_progress import ShardProgress
from nbaccel.errors import CheckpointMismatchError
from tests.big_modeling.helpers import empty_model, make_model, save_checkpoint

pytest.importorskip("tqdm")


@pytest.fixture
def no_delay(monkeypatch):
    """Show the bar at once (a test's loads are far shorter than DELAY_S)."""
    monkeypatch.setattr(load_progress, "DELAY_S", 0.0)


def test_a_sharded_load_shows_one_step_per_shard_on_stderr(tmp_path, capsys, no_delay) -> None:
    ckpt = save_checkpoint(make_model(), tmp_path, shards=3)
    load_checkpoint_in_model(empty_model(), ckpt)
    err = capsys.readouterr().err
    assert "Loading checkpoint shards" in err and "3/3" in err


def test_show_progress_false_and_single_files_show_nothing(tmp_path, capsys, no_delay) -> None:
    sharded = save_checkpoint(make_model(), tmp_path / "sharded", shards=3)
    load_checkpoint_and_dispatch(empty_model(), sharded, {"": "cpu"}, show_progress=False)
    single = save_checkpoint(make_model(), tmp_path / "single")
    load_checkpoint_in_model(empty_model(), single)
    assert "Loading checkpoint shards" not in capsys.readouterr().err


def test_a_load_shorter_than_the_delay_shows_no_bar(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(load_progress, "DELAY_S", 3600.0)
    load_checkpoint_in_model(empty_model(), save_checkpoint(make_model(), tmp_path, shards=3))
    assert "Loading checkpoint shards" not in capsys.readouterr().err


def test_the_bar_counts_offloaded_and_tied_keys_once(tmp_path, capsys, no_delay) -> None:
    ckpt = save_checkpoint(make_model(), tmp_path, shards=2)
    model = load_checkpoint_and_dispatch(empty_model(), ckpt, {"": "cpu", "blocks": "disk"})
    assert model.blocks[0].up.weight.device.type == "meta"
    err = capsys.readouterr().err
    assert "2/2" in err and "3/2" not in err


def test_a_failed_load_leaves_no_bar_open(tmp_path, monkeypatch, no_delay) -> None:
    closed = []
    monkeypatch.setattr(ShardProgress, "close", lambda self: closed.append(self.finished))
    ckpt = save_checkpoint(make_model(), tmp_path, shards=2)
    model = empty_model()
    model.extra = torch.nn.Linear(2, 2, device="meta")
    with pytest.raises(CheckpointMismatchError):
        load_checkpoint_in_model(model, ckpt)
    assert closed == []  # checked before any bar opens
    monkeypatch.setattr("nbaccel.big_modeling.loading.set_module_tensor_to_device",
                        lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        load_checkpoint_in_model(empty_model(), ckpt)
    assert closed == [0]


def test_shard_progress_counts_files_whose_keys_are_all_done(no_delay) -> None:
    with ShardProgress({"a": "1", "b": "1", "c": "2"}, show=False) as bar:
        bar.done("a")
        assert bar.finished == 0
        bar.done_all(["b", "b", "unknown", "c"])
        bar.tick()
        assert bar.finished == 2 and bar.bar is None
    with ShardProgress({"a": "1", "b": "2"}) as bar:
        bar.done("a")
        bar.tick()
        assert bar.bar.n == 1


def test_reports_from_reader_threads_move_the_bar_in_the_callers_thread(no_delay) -> None:
    import threading

    with ShardProgress({"a": "1", "b": "2"}) as bar:
        reader = threading.Thread(target=bar.done_all, args=(["a", "b"],))
        reader.start()
        reader.join()
        assert bar.bar is None  # a reader only counts
        bar.tick()
        assert bar.bar.n == 2
