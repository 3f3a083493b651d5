"""Fault matrix, round two, the full-disk row: ``save_state`` onto a full disk says so and loses nothing.

On a real 20 MiB tmpfs (in a private mount namespace, where this runs as root) and, everywhere, with
``ENOSPC`` raised at the write layer: the error is a ``CheckpointDiskFullError`` naming the folder,
the bytes needed and the bytes free; the partial ``.nbaccel-tmp`` copy is gone; the previous
checkpoint loads as it was saved; and once space is freed the same ``save_state`` call works.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nbaccel.errors import CheckpointDiskFullError
from tests.faults.helpers import Trainer, assert_same

ON_A_TMPFS = """
    import json, os, sys
    from pathlib import Path
    import torch
    import nbaccel
    from nbaccel.errors import CheckpointDiskFullError

    mount = Path(sys.argv[1])
    ballast = mount / "ballast"
    ballast.write_bytes(bytes(10 << 20))            # 10 of the 20 MiB
    torch.manual_seed(0)
    accelerator = nbaccel.Accelerator(cpu=True)
    model = torch.nn.Linear(1024, 1024)             # 4 MiB of weights
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)   # and 4 MiB of momentum
    model, optimizer = accelerator.prepare(model, optimizer)

    def step():
        model(torch.randn(2, 1024)).sum().backward(); optimizer.step(); optimizer.zero_grad()

    step()
    accelerator.save_state(mount / "ckpt")           # about 8 MiB: fits
    first = {k: v.clone() for k, v in model.state_dict().items()}
    step()
    report = {}
    try:
        accelerator.save_state(mount / "ckpt")       # another 8 MiB beside it: does not
    except CheckpointDiskFullError as exc:
        report.update(type=type(exc).__name__, message=str(exc), path=exc.path, needed=exc.bytes_needed,
                      free=exc.bytes_free)
    report["left"] = sorted(p.name for p in mount.iterdir())
    second = {k: v.clone() for k, v in model.state_dict().items()}
    accelerator.load_state(mount / "ckpt")
    report["previous_intact"] = all(torch.equal(first[k], v) for k, v in model.state_dict().items())
    model.load_state_dict(second)
    ballast.unlink()                                 # free space, and save again
    accelerator.save_state(mount / "ckpt")
    accelerator.load_state(mount / "ckpt")
    report["retry_saved_second"] = all(torch.equal(second[k], v) for k, v in model.state_dict().items())
    report["left_after_retry"] = sorted(p.name for p in mount.iterdir())
    print("REPORT", json.dumps(report))
"""


def test_save_state_on_a_full_tmpfs_says_so_and_keeps_the_previous_checkpoint(tmp_path):
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("mounting a tmpfs needs root and unshare; the faked ENOSPC test below runs everywhere")
    script = tmp_path / "fill.py"
    script.write_text(textwrap.dedent(ON_A_TMPFS))
    mount = tmp_path / "mnt"
    mount.mkdir()
    command = f"mount -t tmpfs -o size=20m tmpfs {mount} && exec {sys.executable} {script} {mount}"
    done = subprocess.run(["unshare", "-m", "sh", "-c", command], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    if "mount:" in done.stderr and "REPORT" not in done.stdout:
        pytest.skip(f"this machine does not allow a private tmpfs: {done.stderr.strip()[:200]}")
    report = json.loads(done.stdout.split("REPORT ", 1)[1]) if "REPORT" in done.stdout else None
    assert report is not None, done.stderr[-3000:]
    assert report["type"] == "CheckpointDiskFullError" and report["path"] == str(mount / "ckpt")
    assert "the disk is full" in report["message"] and "Fix:" in report["message"]
    assert report["needed"] >= 8 << 20 and report["free"] < report["needed"]
    assert report["left"] == ["ballast", "ckpt"]  # no .ckpt.nbaccel-tmp keeps the disk full
    assert report["previous_intact"] and report["retry_saved_second"]
    assert report["left_after_retry"] == ["ckpt"]


def test_save_state_with_enospc_at_the_write_layer_says_so_and_loses_nothing(tmp_path, monkeypatch):
    import safetensors.torch

    trainer = Trainer(seed=0)
    trainer.train(2)
    trainer.accelerator.save_state(tmp_path / "ckpt")
    first = trainer.snapshot()
    trainer.train(2)
    second = trainer.snapshot()
    real_save = safetensors.torch.save_file

    def half_then_full(tensors, filename, metadata=None):
        Path(filename).write_bytes(bytes(4096))  # part of the file made it to disk
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", half_then_full)
    with pytest.raises(CheckpointDiskFullError) as info:
        trainer.accelerator.save_state(tmp_path / "ckpt")
    error = info.value
    assert error.path == str(tmp_path / "ckpt") and "the disk is full" in str(error)
    assert error.bytes_needed >= sum(f.stat().st_size for f in (tmp_path / "ckpt").iterdir())
    assert error.bytes_free > 0 and isinstance(error.__cause__, OSError)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # the partial copy is gone
    reloaded = Trainer(seed=1)
    reloaded.accelerator.load_state(tmp_path / "ckpt")
    assert_same(reloaded.snapshot(), first)  # the previous checkpoint is intact
    monkeypatch.setattr(safetensors.torch, "save_file", real_save)  # space is back
    trainer.accelerator.save_state(tmp_path / "ckpt")
    again = Trainer(seed=1)
    again.accelerator.load_state(tmp_path / "ckpt")
    assert_same(again.snapshot(), second)


def test_other_write_failures_are_not_called_a_full_disk(tmp_path, monkeypatch):
    import safetensors.torch

    trainer = Trainer(seed=0)

    def broken(tensors, filename, metadata=None):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    with pytest.raises(OSError, match="Input/output error") as info:
        trainer.accelerator.save_state(tmp_path / "ckpt")
    assert not isinstance(info.value, CheckpointDiskFullError)
