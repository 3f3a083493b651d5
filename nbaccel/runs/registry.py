"""This kernel's runs, by id: what ``%accel_runs`` lists, and what is cancelled when the kernel exits.

Ids count from 1 per process. Running runs are always kept; of the ended ones, the latest
:data:`KEPT_RUNS` (their records hold bounded output, and a background run's result). At
interpreter exit (a kernel's shutdown or restart) every running background run is cancelled,
each rank stopped as Ctrl-C stops it; a kernel that is killed instead takes its ranks with it
(``PR_SET_PDEATHSIG`` and the group reaper, :mod:`nbaccel.launch.reaper`).
"""

from __future__ import annotations

import atexit
import itertools
import threading
from typing import Any

__all__ = ["KEPT_RUNS", "add_run", "all_runs", "cancel_running", "find_run", "next_run_id"]

KEPT_RUNS = 20
"""Ended runs kept for ``%accel_runs`` (the oldest go first); running ones are always kept."""

_lock = threading.Lock()
_ids = itertools.count(1)
_runs: dict[int, Any] = {}  # id -> LaunchRun (typed loosely: the handle module imports this one)


def next_run_id() -> int:
    """A new run id."""
    with _lock:
        return next(_ids)


def add_run(run: Any) -> None:
    """Keep ``run`` (a :class:`~nbaccel.runs.handle.LaunchRun`); forget the oldest ended runs past :data:`KEPT_RUNS`."""
    with _lock:
        _runs[run.id] = run
        ended = [r for r in _runs.values() if r.done()]
        for old in ended[:max(0, len(ended) - KEPT_RUNS)]:
            del _runs[old.id]


def all_runs() -> list[Any]:
    """Every kept run, oldest first."""
    with _lock:
        return sorted(_runs.values(), key=lambda r: r.id)


def find_run(run_id: int | None) -> Any | None:
    """Run ``run_id``, or the latest run when ``None``; ``None`` when there is no such run."""
    with _lock:
        if run_id is None:
            return _runs[max(_runs)] if _runs else None
        return _runs.get(run_id)


def cancel_running() -> list[int]:
    """Cancel every running background run (each rank stopped); the ids cancelled."""
    cancelled = []
    for run in all_runs():
        if run.background and not run.done() and run.cancel(timeout=15):  # a kernel's exit must not hang on one
            cancelled.append(run.id)
    return cancelled


atexit.register(cancel_running)
