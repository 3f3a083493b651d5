"""One checkpoint folder shared by savers and loaders: saves take turns, and a load reads one whole save.

A save writes a new folder beside the checkpoint and renames it into place (see
:mod:`nbaccel.training.checkpointing`); each such folder is one generation, never changed once
complete. Three locks (``flock``, released by the kernel when a process dies) keep processes that
share the folder apart:

::

    saver A ──LOCK_EX .ckpt.nbaccel-lock──► writes .ckpt.nbaccel-tmp, swaps it in ──► unlocks
    saver B ──LOCK_EX (waits for A) ─────────────────────────────────────────────────► its turn
    loader  ──open ckpt/ (one generation, by descriptor) ─LOCK_SH─► reads every file ──► unlocks
    saver   ──LOCK_EX on the generation it removes (waits for its loaders) ──► marker, then files

What always holds on Linux: a load reads every file from the one generation it opened (the files
are opened through ``/proc/self/fd/<dir>``, so a rename that swaps in the next save does not
redirect them), and that generation is not removed until the load has read it (so a save waits
for a load that is still reading the previous save). Where ``/proc/self/fd`` or ``flock`` is
missing, files are read by path (a concurrent save may then mix).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from nbaccel.errors import CheckpointError

__all__ = ["MARKER", "PinnedCheckpoint", "exclusive_folder", "one_saver", "pinned_checkpoint", "siblings"]

MARKER = "nbaccel_checkpoint.json"
_SETTLE_S = 1.0  # how long a load waits for a save caught between its two renames (microseconds, when idle)


def siblings(folder: Path) -> tuple[Path, Path]:
    """The save in progress and the previous generation beside ``folder``: ``.<name>.nbaccel-tmp`` / ``-old``."""
    return folder.with_name(f".{folder.name}.nbaccel-tmp"), folder.with_name(f".{folder.name}.nbaccel-old")


def _lock(fd: int, operation: int) -> None:
    with contextlib.suppress(OSError):  # a filesystem without flock (some network ones): no lock, as before
        fcntl.flock(fd, operation)


@contextlib.contextmanager
def one_saver(folder: Path) -> Iterator[None]:
    """Hold ``folder``'s save lock: a second process saving into it waits here until this save ends.

    The lock file is removed while held, and a waiter that then finds its file unlinked locks the
    new one instead, so no lock file outlives a save and no two savers ever hold one.
    """
    lock = folder.with_name(f".{folder.name}.nbaccel-lock")
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        _lock(fd, fcntl.LOCK_EX)
        try:
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # the saver before us removed this file: lock the next one
    try:
        yield
    finally:
        try:
            with contextlib.suppress(OSError):
                os.unlink(lock)
        finally:  # even when the process is dying here: the lock must not outlive this save
            os.close(fd)


def _open_folder(path: Path) -> int | None:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None


@contextlib.contextmanager
def exclusive_folder(folder: Path) -> Iterator[int | None]:
    """Lock the generation at ``folder`` exclusively (waiting for its loaders); yields its descriptor, or None."""
    fd = _open_folder(folder)
    if fd is None:
        yield None
        return
    try:
        _lock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)


@dataclass(frozen=True)
class PinnedCheckpoint:
    """One generation held open for reading.

    Attributes:
        path: the folder's name (for messages and ``load_state``'s return value).
        root: where to read its files: ``/proc/self/fd/<n>``, which names this generation
            whatever is renamed over ``path`` meanwhile (``path`` itself where /proc is missing).
        complete: it holds the marker a finished nbaccel save writes (``False``: Accelerate's layout).
    """

    path: Path
    root: Path
    complete: bool


def _has_marker(fd: int) -> bool:
    try:
        os.stat(MARKER, dir_fd=fd)
    except FileNotFoundError:
        return False
    return True


def _accelerate_layout(fd: int) -> bool:
    """Written by Accelerate: no marker, but its file names."""
    names = os.listdir(fd)
    return ((any(n.startswith("model") for n in names) and "optimizer.bin" in names)
            or any(n.startswith("random_states_") and n.endswith(".pkl") for n in names))


def _still_named(path: Path, fd: int) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _pin(candidate: Path) -> int | None:
    """Open and share-lock ``candidate`` if it is a complete generation (its descriptor); else None."""
    fd = _open_folder(candidate)
    if fd is None:
        return None
    _lock(fd, fcntl.LOCK_SH)  # from here no save removes it; one that already began has unlinked its marker
    if _has_marker(fd):
        return fd
    os.close(fd)
    return None


def _try_pin(folder: Path) -> tuple[int, Path, bool] | bool:
    """Open and share-lock the generation to read: ``(fd, path, complete)``; else whether a save may be moving it."""
    fd = _open_folder(folder)
    if fd is not None:
        _lock(fd, fcntl.LOCK_SH)
        if _has_marker(fd):
            return fd, folder, True
        named = _still_named(folder, fd)
        if named and _accelerate_layout(fd):
            return fd, folder, False
        os.close(fd)
        return not named  # renamed away or removed after we opened it: the next look finds the new one
    tmp, old = siblings(folder)
    for left in (old, tmp):  # the folder is missing: a save between its two renames, or a crash there
        pinned = _pin(left)
        if pinned is not None:
            return pinned, left, True
    return folder.exists() or old.exists() or tmp.exists()


@contextlib.contextmanager
def pinned_checkpoint(folder: Path) -> Iterator[PinnedCheckpoint]:
    """Hold the complete checkpoint at ``folder`` (or the one a crash mid-swap left beside it) for reading.

    Raises:
        CheckpointError: no complete checkpoint is there.
    """
    deadline = time.monotonic() + _SETTLE_S
    while True:
        found = _try_pin(folder)
        if isinstance(found, tuple) or not found or time.monotonic() > deadline:
            break
        time.sleep(0.002)  # a save is between its two renames: the next look finds its result
    if not isinstance(found, tuple):
        raise CheckpointError(f"no complete checkpoint at {str(folder)!r}: it has no {MARKER} (an interrupted "
                              "save leaves the previous checkpoint in place, or none if there was none); pass the "
                              "folder a finished save_state wrote", path=str(folder))
    fd, path, complete = found
    proc = Path(f"/proc/self/fd/{fd}")
    try:
        yield PinnedCheckpoint(path, proc if proc.is_dir() else path, complete)
    finally:
        os.close(fd)
