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
    assert len(closed) == 1  # closed once (the files already read may have counted)


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


class _Screen:
    """Stands in for stderr: keeps each count the bar draws, with what ``during()`` said then."""

    def __init__(self, during) -> None:  # a no-argument callable
        self.during, self.draws = during, []

    def write(self, text: str) -> int:
        import re

        self.draws += [(int(n), self.during()) for n in re.findall(r"\| *(\d+)/\d+ ", text)]
        return len(text)

    def flush(self) -> None:
        pass


def test_the_bar_moves_while_the_shards_are_copied_not_after(tmp_path, monkeypatch, no_delay) -> None:
    from tests.big_modeling.helpers import TinyLM

    torch.manual_seed(0)
    source = TinyLM(width=1024, blocks=6)  # ~100 MiB in 6 shards, 8 bytes off: every weight copied
    ckpt = save_checkpoint(source, tmp_path, shards=6, data_start=8)
    model = empty_model(width=1024, blocks=6)
    screen = _Screen(lambda: all(p.is_meta for p in model.parameters()))
    monkeypatch.setattr("sys.stderr", screen)
    load_checkpoint_in_model(model, ckpt, dtype=torch.float64)
    counts = [n for n, _ in screen.draws]
    assert counts == sorted(counts) and counts[-1] == 6, screen.draws
    # drawn by the caller's thread while the readers still copied (no weight in the model yet)
    assert any(0 < n < 6 for n, reading in screen.draws if reading), screen.draws
    assert torch.equal(model.blocks[5].up.weight, source.blocks[5].up.weight.double())


def test_gpu_reads_move_the_bar_as_each_shard_lands(tmp_path, monkeypatch, no_delay) -> None:
    import threading

    import safetensors.torch

    from nbaccel.big_modeling.checkpoint_files import SafetensorsFile
    from nbaccel.big_modeling.device_reads import read_to_devices

    infos, file_of = [], {}
    for shard in range(6):  # the reads staged_to_gpus does, on CPU tensors: 6 shards of 16 MiB
        path = tmp_path / f"s{shard}.safetensors"
        safetensors.torch.save_file({f"w{shard}.{i}": torch.full((2**20,), float(i)) for i in range(4)},
                                    str(path))
        for key, info in SafetensorsFile(path).tensors.items():
            infos.append(info)
            file_of[key] = str(path)
    keys, left, lock = list(file_of), [i.nbytes for i in infos], threading.Lock()
    reading = {"now": False}
    screen = _Screen(lambda: reading["now"])
    monkeypatch.setattr("sys.stderr", screen)
    with ShardProgress(file_of) as progress:
        def report(k: int, n: int) -> None:
            with lock:
                left[k] -= n
                finished = left[k] == 0
            if finished:
                progress.done(keys[k])

        reading["now"] = True
        read_to_devices(infos, ["cpu"] * len(infos), buffer_bytes=2**20, readers=2,
                        on_piece=report, on_wait=progress.tick, wake=progress.moved)
        reading["now"] = False
    counts = [n for n, _ in screen.draws]
    assert counts == sorted(counts) and counts[-1] == 6, screen.draws
    assert any(0 < n < 6 for n, during in screen.draws if during), screen.draws
