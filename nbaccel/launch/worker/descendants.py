"""A worker's descendants end with it: the worker is a child subreaper that kills and reaps them.

A daemon leaves the worker's process group (``setsid``, a double fork), so ``killpg`` cannot reach
it. Each worker marks itself a child subreaper (``PR_SET_CHILD_SUBREAPER``), so every orphan below
it becomes its direct child; when the worker ends it SIGKILLs and reaps its children, round after
round, until none is left.

What always holds: a worker that ends by returning, raising, being interrupted, or ``SIGTERM``
leaves no descendant running. Not covered: a worker killed by ``SIGKILL`` (what left its group
then lives on under init). Reparented orphans that exit while the worker runs stay zombies until
it ends (reaping them earlier could take an exit status a ``subprocess.Popen`` waits for).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from typing import Any

from nbaccel.launch.reaper import remove_watched_folders

__all__ = ["become_subreaper", "end_descendants", "end_descendants_on_sigterm"]

_PR_SET_CHILD_SUBREAPER = 36
_MAX_ROUNDS = 1000  # each round ends one generation; a fork bomb must not keep the worker forever
_REAP_TIMEOUT_S = 5.0  # after SIGKILL: only a process stuck in the kernel takes longer


def become_subreaper() -> bool:
    """Mark this process a child subreaper (Linux 3.4+); returns whether it now is one.

    Example:
        >>> become_subreaper() in (True, False)      # doctest: +SKIP
        True
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):  # pragma: no cover - exotic libc
        return False


def _children() -> list[int]:
    """This process's direct children (every thread's), from /proc (os.listdir and open: half pathlib's cost)."""
    found: list[int] = []
    tasks = f"/proc/{os.getpid()}/task"
    try:
        threads = os.listdir(tasks)
    except OSError:
        return found
    for thread in threads:
        try:
            with open(f"{tasks}/{thread}/children", "rb") as children:
                found += [int(c) for c in children.read().split()]
        except OSError:  # the thread ended, or a kernel without CONFIG_PROC_CHILDREN
            continue
    return found


def _has_children() -> bool:
    """Whether any process (live or exited) is a child of this one: one syscall, where /proc costs a read per thread."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)  # reaps nothing; children of every thread
    except ChildProcessError:
        return False
    return True


def end_descendants() -> int:
    """SIGKILL and reap every descendant of this process, then remove the pool folders it made; returns how many.

    A pool (or warm rank) this process holds is among the descendants; so is the group reaper that
    would have removed its socket folder, so the folder is removed here.

    Example:
        >>> import subprocess
        >>> _ = subprocess.Popen(["sleep", "60"])      # doctest: +SKIP
        >>> end_descendants()                          # doctest: +SKIP
        1
    """
    ended = 0
    for _ in range(_MAX_ROUNDS if _has_children() else 0):
        children = _children()
        if not children:
            break
        for child in children:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + _REAP_TIMEOUT_S
        for child in children:
            try:
                while not os.waitpid(child, os.WNOHANG)[0]:
                    if time.monotonic() > deadline:  # stuck in the kernel: the rank must not hang on it
                        print(f"nbaccel: pid {child} did not exit within {_REAP_TIMEOUT_S:g}s of SIGKILL (stuck in the "
                              f"kernel: see `cat /proc/{child}/stack`); not waiting for it", file=sys.stderr)
                        remove_watched_folders()
                        return ended
                    time.sleep(0.0005)
                ended += 1
            except ChildProcessError:  # reaped by someone else (a Popen's own wait)
                pass
    remove_watched_folders()
    return ended


def _end_on_sigterm(signum: int, frame: Any) -> None:
    end_descendants()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)  # die of the signal, as the launcher expects


def end_descendants_on_sigterm() -> None:
    """On ``SIGTERM``, end every descendant, then die of ``SIGTERM`` as if no handler were set.

    Example:
        >>> end_descendants_on_sigterm()             # doctest: +SKIP
    """
    signal.signal(signal.SIGTERM, _end_on_sigterm)
