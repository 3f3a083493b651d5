"""Fault matrix, checkpoint rows: a crash at any point of ``save_state`` loses nothing.

The save is cut before each of its filesystem steps in turn (see :mod:`tests.faults.fs_faults`),
once and then twice in a row (a crash, then another during the next save). Afterwards
``load_state`` must find a complete checkpoint, one of those that were saved or being saved, with
every file from the same save; the next save that finishes must leave no temporary folder behind.
A few of the cuts are real SIGKILLs of a process, the rest are simulated in this one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import nbaccel
from tests.faults.fs_faults import FilesystemSteps, count_steps
from tests.faults.helpers import Trainer, assert_same

ROOT = Path(__file__).resolve().parents[2]


class Versions:
    """One trainer saving successive versions (its counter numbers them) and one loading them back."""

    def __init__(self) -> None:
        self.saver = Trainer(seed=0)
        self.loader = Trainer(seed=1)
        self.saved: dict[int, dict] = {}

    def next_version(self) -> None:
        self.saver.train(1)
        self.saved[self.saver.counter.count] = self.saver.snapshot()

    def save(self, folder: Path | None, crash_at: int | None = None) -> None:
        with FilesystemSteps(crash_at):
            self.saver.accelerator.save_state(folder)

    def load_and_check(self, folder: Path | None, allowed: set[int]) -> int:
        """Load, and check the state is exactly one whole version among ``allowed``; returns it."""
        self.loader.accelerator.load_state(folder)
        got = self.loader.snapshot()
        version = got["count"]
        assert version in allowed
        expected = self.saved[version]
        assert_same(got["model"], expected["model"])
        assert_same(got["optimizer"], expected["optimizer"])
        assert_same(got["scheduler"], expected["scheduler"])
        return version


def _siblings(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}."))


@pytest.fixture(scope="module")
def step_count(tmp_path_factory) -> int:
    folder = tmp_path_factory.mktemp("count") / "ckpt"
    versions = Versions()
    versions.next_version()
    versions.saver.accelerator.save_state(folder)
    return len(count_steps(lambda: versions.saver.accelerator.save_state(folder)))


def test_the_save_has_the_filesystem_steps_the_matrix_cuts(step_count):
    assert step_count >= 20  # mkdir, 7 files, marker, renames, the old copy's removal


def test_one_crash_before_any_step_keeps_a_whole_checkpoint(tmp_path, step_count):
    versions = Versions()
    folder = tmp_path / "ckpt"
    versions.next_version()
    versions.save(folder)
    for cut in range(1, step_count + 2):  # the last one does not crash
        whole = versions.saver.counter.count
        versions.next_version()
        versions.save(folder, crash_at=cut)
        now = versions.saver.counter.count
        version = versions.load_and_check(folder, {whole, now})
        if cut > step_count:
            assert version == now  # no crash: the new one
        versions.next_version()
        versions.save(folder)
    assert versions.load_and_check(folder, {versions.saver.counter.count}) and _siblings(folder) == []


def test_two_crashes_in_a_row_at_any_two_steps_keep_a_whole_checkpoint(tmp_path, step_count):
    versions = Versions()
    for first in range(1, step_count + 1):
        folder = tmp_path / f"ckpt_{first}"
        versions.next_version()
        versions.save(folder)
        whole = versions.saver.counter.count
        for second in range(1, step_count + 1):
            versions.next_version()
            versions.save(folder, crash_at=first)
            versions.next_version()
            versions.save(folder, crash_at=second)
            now = versions.saver.counter.count
            loaded = versions.load_and_check(folder, {whole, now - 2, now - 1, now})
            whole = max(loaded, whole)
    versions.next_version()
    versions.save(folder)
    assert _siblings(folder) == []


def test_a_crash_during_automatic_checkpointing_with_total_limit_1_keeps_the_last_one(tmp_path, step_count):
    versions = Versions()
    config = nbaccel.ProjectConfiguration(str(tmp_path), automatic_checkpoint_naming=True, total_limit=1)
    versions.saver.accelerator.project_configuration = config
    versions.loader.accelerator.project_configuration = nbaccel.ProjectConfiguration(
        str(tmp_path), automatic_checkpoint_naming=True)
    versions.next_version()
    versions.save(None)
    for cut in range(1, step_count + 1):
        versions.next_version()
        versions.save(None, crash_at=cut)
        now = versions.saver.counter.count
        versions.load_and_check(None, {now - 1, now})
        # as a restarted process does after load_state(): number on from the newest complete checkpoint
        config.iteration = versions.loader.accelerator.project_configuration.iteration
        versions.next_version()
        versions.save(None)  # the next save after a crash finishes and prunes to one
        assert len(list((tmp_path / "checkpoints").glob("checkpoint_*"))) == 1


_KILLED_SAVE = textwrap.dedent("""
    import sys
    from pathlib import Path
    from tests.faults.fs_faults import FilesystemSteps
    from tests.faults.helpers import Trainer

    folder, step = Path(sys.argv[1]), sys.argv[2]
    trainer = Trainer(seed=0)
    trainer.train(1)
    trainer.accelerator.save_state(folder)      # version 1, whole
    trainer.train(1)
    trainer.accelerator.save_state(folder.with_name("dry"))
    with FilesystemSteps() as dry:              # version 2: find the step to die before, in a rehearsal
        trainer.accelerator.save_state(folder.with_name("dry"))
    cut = next(i for i, s in enumerate(dry.steps, 1) if s.startswith(step))
    with FilesystemSteps(crash_at=cut, kill=True):
        trainer.accelerator.save_state(folder)
    print("not killed")
""")


@pytest.mark.parametrize("step", ["save optimizer.bin", "rename .dry.nbaccel-tmp", "unlink model.safetensors"])
def test_a_process_sigkilled_mid_save_leaves_a_whole_checkpoint(tmp_path, step):
    folder = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for _ in range(2 if "rename" in step else 1):  # between the renames: killed there in two saves in a row
        done = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(folder), step], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == -9, done.stderr
    trainer = Trainer(seed=5)
    trainer.accelerator.load_state(folder)
    assert trainer.counter.count in (1, 2)
    trainer.accelerator.save_state(folder)
    assert _siblings(folder) == []
