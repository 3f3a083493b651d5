"""What the ranks of the latest run posted for their caller with ``accelerator.log``, kept as it arrives.

The supervisor adds every ``log`` frame a rank sends (:mod:`nbaccel.launch.worker.channel`) to the
run's :class:`RunLog` and hands each record to the observer's ``on_log`` (the live chart). The
tracking pillar reads it back (:func:`nbaccel.last_run_history`); the launch core knows nothing of
trackers. One log per process: each run's replaces the one before it.
"""

from __future__ import annotations

import threading
from typing import Any

from nbaccel.identity import rank_generation

__all__ = ["RunLog", "begin_run_log", "last_run_log"]


class RunLog:
    """The records one run's ranks logged, in arrival order.

    Attributes:
        records: ``{"step": int, "time": float, <metric>: value, ...}`` dicts.
        project: the project name given to ``init_trackers`` (``None`` before it).
        config: the configuration given to ``init_trackers``.

    Example:
        >>> log = RunLog()
        >>> log.add(0, {"items": [{"step": 0, "time": 0.0, "loss": 1.0}]})[0]["loss"]
        1.0
    """

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.project: str | None = None
        self.config: dict[str, Any] = {}
        self._lock = threading.Lock()

    def add(self, rank: int, body: dict[str, Any]) -> list[dict[str, Any]]:
        """Take one ``log`` frame's body from ``rank``; return the records it carried (a batch, or none)."""
        if "project" in body:
            self.project = body["project"]
        if "config" in body:
            self.config = dict(body["config"])
        records = list(body.get("items", ()))
        with self._lock:
            self.records += records
        return records

    def snapshot(self) -> list[dict[str, Any]]:
        """A copy of the records so far (safe to read while the run still adds to them)."""
        with self._lock:
            return [dict(r) for r in self.records]


_last: tuple[int, RunLog] | None = None  # (the rank generation it was made in, the log)


def begin_run_log() -> RunLog:
    """A fresh log for the run that is starting; it becomes :func:`last_run_log`'s."""
    global _last
    _last = (rank_generation(), RunLog())
    return _last[1]


def last_run_log() -> RunLog | None:
    """The latest run's log (``None`` before any run here, and in a rank that started afresh since).

    The caller's log, inherited through fork, is not a rank's (a launch the rank makes starts its own).
    """
    return _last[1] if _last is not None and _last[0] == rank_generation() else None
