"""Fault matrix, round three: a checkpoint file swapped for a FIFO between the check and the open.

Another process renames a FIFO and the real file over one file of a saved training state, over
and over, while ``load_state`` loads the folder in a loop. A check by path followed by an open by
path lets the FIFO in between the two, and the open (then the load, and Ctrl-C with it) blocks
forever. Each file is opened once, without blocking, and checked on its descriptor: every load
either loads or refuses the FIFO by name, and the loop ends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults.helpers import Trainer

ROOT = Path(__file__).resolve().parents[2]

SWAPPER = """
import os, sys, time
target, real = sys.argv[1], sys.argv[2]
staged_file, staged_fifo = target + ".file", target + ".fifo"
print("swapping", flush=True)
end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    os.mkfifo(staged_fifo)
    os.replace(staged_fifo, target)
    os.link(real, staged_file)
    os.replace(staged_file, target)
"""

LOADER = """
import json, sys, time
from tests.faults.helpers import Trainer
from nbaccel.errors import CheckpointError
trainer = Trainer(seed=1)
loads, refused, other = 0, 0, []
print("ready", flush=True)
sys.stdin.readline()
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    try:
        trainer.accelerator.load_state(sys.argv[1])
        loads += 1
    except CheckpointError as exc:
        refused += 1
        if "FIFO" not in str(exc) or "Fix:" not in str(exc):
            other.append(str(exc))
print(json.dumps({"loads": loads, "refused": refused, "other": other[:3]}), flush=True)
"""


def _python(script: str, *args: object, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)], stdout=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT, **popen)


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.bin"])
def test_a_file_swapped_for_a_fifo_while_loading_never_blocks_load_state(tmp_path, name):
    trainer = Trainer(seed=0)
    trainer.train(2)
    folder = Path(trainer.accelerator.save_state(tmp_path / "ckpt"))
    real = tmp_path / f"{name}.real"
    os.link(folder / name, real)
    loader = _python(LOADER, folder, 4, stdin=subprocess.PIPE)
    assert loader.stdout.readline().strip() == "ready"
    swapper = _python(SWAPPER, folder / name, real, 4)
    try:
        assert swapper.stdout.readline().strip() == "swapping"
        loader.stdin.write("go\n")
        loader.stdin.flush()
        try:
            out = loader.communicate(timeout=120)[0]  # a load blocked on the FIFO never returns
        except subprocess.TimeoutExpired:
            pytest.fail(f"load_state blocked on {name} swapped for a FIFO")
    finally:
        loader.kill()
        swapper.kill()
        swapper.wait()
    report = json.loads(out.strip().splitlines()[-1])
    assert report["other"] == [] and report["loads"] + report["refused"] > 10, report


def test_a_socket_named_like_a_checkpoint_is_refused_by_name(tmp_path):
    import socket

    from nbaccel.big_modeling import load_checkpoint_in_model
    from nbaccel.errors import CheckpointError
    from tests.training.helpers import TinyMLP

    path = tmp_path / "model.safetensors"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))  # opening it fails (ENXIO) rather than giving a descriptor to check
    try:
        with pytest.raises(CheckpointError, match=r"is not a regular file \(it is a socket\).*Fix:") as error:
            load_checkpoint_in_model(TinyMLP(), str(path))
        assert error.value.path == str(path)
    finally:
        server.close()


@pytest.mark.parametrize("marker", ["fifo", "not json"])
def test_a_marker_that_is_a_fifo_or_not_json_is_refused_and_changes_nothing(tmp_path, marker):
    from nbaccel.errors import CheckpointError
    from tests.faults.helpers import assert_same
    from tests.faults.test_hostile_checkpoints import _returns_without_blocking

    trainer = Trainer(seed=0)
    trainer.train(2)
    folder = Path(trainer.accelerator.save_state(tmp_path / "ckpt"))
    path = folder / "nbaccel_checkpoint.json"
    path.unlink()
    os.mkfifo(path) if marker == "fifo" else path.write_text("[1, 2")
    other = Trainer(seed=1)
    before = other.snapshot()
    error = _returns_without_blocking(lambda: other.accelerator.load_state(folder))
    assert isinstance(error, CheckpointError) and error.path == str(path), error
    assert ("FIFO" if marker == "fifo" else "not the JSON object") in str(error) and "Fix:" in str(error)
    assert_same(other.snapshot(), before)
