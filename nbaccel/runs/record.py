"""`RunRecord`: one run's states, output, logged metrics and displays, kept for its handle and its views.

The record is the run's observer (:class:`~nbaccel.launch.events.LaunchObserver`). It keeps what
the status panel's plain-text form keeps (:class:`~nbaccel.widgets.status_panel.LaunchStatus`),
and also:

- each rank's lines, bounded to :data:`OUTPUT_CHARS` characters in memory; once a rank passes
  that bound its whole output goes to ``rank<N>.log`` in a folder of the run's own, which the
  kept text names (the bound holds however long the run prints);
- the last :data:`TAIL_LINES` lines of every rank as the cell would show them (``[rankN]: ...``),
  for a view shown later;
- what the ranks displayed (the last :data:`KEPT_DISPLAYS`).

Views attach while the run goes on (:meth:`RunRecord.attach`): under the record's lock they get
what happened so far, then every later event, so nothing is shown twice or lost. An ``inner``
observer (a blocking cell's own status panel) gets every event as it would without the record.
"""

from __future__ import annotations

import tempfile
import threading
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, Literal, Protocol, TypeVar

from nbaccel.launch.events import LaunchObserver, RankState, as_observer
from nbaccel.widgets.status_panel import LaunchStatus

__all__ = ["KEPT_DISPLAYS", "OUTPUT_CHARS", "TAIL_LINES", "RankText", "RunRecord", "RunView"]

OUTPUT_CHARS = 200_000
"""Characters of each rank's output kept in memory; past that, the rank's whole output is in its log file."""
TAIL_LINES = 400
"""Lines of output (every rank's, in arrival order) that a view shown later starts with."""
KEPT_DISPLAYS = 50
"""The latest displays (figures, ``display()``) of a run kept for a view shown later."""

Stream = Literal["stdout", "stderr"]


class RankText(str):
    """What one rank printed (its last :data:`OUTPUT_CHARS` characters), with the log file of the whole.

    Attributes:
        log_file: the file holding every line the rank printed, once it printed past the bound
            (``None`` while everything fits in memory).
    """

    log_file: str | None = None


class RunView(Protocol):
    """A live view of a run (:mod:`nbaccel.runs.view`): it gets the record's events after it attached."""

    def on_state(self, rank: int, state: RankState) -> None: ...
    def on_output(self, rank: int, stream: Stream, line: str) -> None: ...
    def on_progress(self, rank: int, stream: Stream, text: str) -> None: ...
    def on_log(self, rank: int, record: dict[str, Any]) -> None: ...
    def on_display(self, rank: int, kind: str, body: dict[str, Any], labelled: bool) -> None: ...
    def on_end(self, ok: bool) -> None: ...


_View = TypeVar("_View", bound=RunView)  # attach returns the factory's own view type


class RunRecord(LaunchStatus):
    """The record of one run (see the module docstring).

    Args:
        num_processes: the ranks expected.
        title: the run's heading (``"run 3 · In[7] · 2 processes"``).
        inner: an observer that also gets every event (a blocking cell's own status panel).

    Example:
        >>> record = RunRecord(1)
        >>> record.on_launch([0], "fork"); record.on_output(0, "stdout", "epoch 1")
        >>> record.output(0), record.tail[-1]
        ('epoch 1\\n', '[rank0]: epoch 1')
    """

    def __init__(self, num_processes: int, title: str = "nbaccel run", inner: LaunchObserver | None = None) -> None:
        super().__init__(num_processes, title)
        self.lock = threading.RLock()
        self.inner = as_observer(inner)
        # a panel that draws bars itself: the relay then writes only each bar's final line to the cell
        self.shows_progress = self.inner is not None and self.inner.shows_progress
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.displays: deque[tuple[int, str, dict[str, Any], bool]] = deque(maxlen=KEPT_DISPLAYS)
        self._views: list[RunView] = []
        self._kept: dict[int, deque[str]] = {}
        self._kept_chars: dict[int, int] = {}
        self._dropped: dict[int, int] = {}
        self._logs: dict[int, IO[str]] = {}
        self._folder: Path | None = None

    # ------------------------------------------------------------------ views
    def attach(self, view_factory: Callable[[RunRecord], _View]) -> _View:
        """Build a view from the record as it is now (under the lock) and send it every later event."""
        with self.lock:
            view = view_factory(self)
            if self.ok is None:
                self._views.append(view)
            return view

    def detach(self, view: RunView) -> None:
        """Stop sending events to ``view``."""
        with self.lock:
            if view in self._views:
                self._views.remove(view)

    def _each(self, call: Callable[[Any], None]) -> None:
        for view in list(self._views):
            try:
                call(view)
            except Exception:  # noqa: BLE001 - a broken view (a closed comm) must not stop the run
                self._views.remove(view)

    # ------------------------------------------------------------------ observer
    def on_launch(self, ranks: Sequence[int], start_method: str) -> None:
        """The workers are about to start."""
        with self.lock:
            super().on_launch(ranks, start_method)
        if self.inner is not None:
            self.inner.on_launch(ranks, start_method)

    def on_state(self, rank: int, state: RankState) -> None:
        """Rank ``rank`` moved to ``state``."""
        with self.lock:
            super().on_state(rank, state)
            self._each(lambda view: view.on_state(rank, state))
        if self.inner is not None:
            self.inner.on_state(rank, state)

    def on_output(self, rank: int, stream: Stream, line: str) -> None:
        """Rank ``rank`` printed ``line``: kept (bounded), logged past the bound, sent to the views."""
        with self.lock:
            super().on_output(rank, stream, line)
            self._keep(rank, line)
            self.tail.append(f"[rank{rank}]: {line}")
            self._each(lambda view: view.on_output(rank, stream, line))
        if self.inner is not None:
            self.inner.on_output(rank, stream, line)

    def on_progress(self, rank: int, stream: Stream, text: str) -> None:
        """Rank ``rank`` redrew its progress bar."""
        with self.lock:
            super().on_progress(rank, stream, text)
            self._each(lambda view: view.on_progress(rank, stream, text))
        if self.inner is not None:
            self.inner.on_progress(rank, stream, text)

    def on_log(self, rank: int, record: dict[str, Any]) -> None:
        """Rank ``rank`` logged ``record`` with ``accelerator.log``."""
        with self.lock:
            super().on_log(rank, record)
            self._each(lambda view: view.on_log(rank, record))
        if self.inner is not None:
            self.inner.on_log(rank, record)

    def on_display(self, rank: int, kind: str, body: dict[str, Any], labelled: bool) -> None:
        """Rank ``rank`` displayed something (a background run's displays come here, not to a cell)."""
        with self.lock:
            self.displays.append((rank, kind, body, labelled))
            self._each(lambda view: view.on_display(rank, kind, body, labelled))

    def on_end(self, ok: bool) -> None:
        """Every worker is gone: the log files are closed (they stay on disk), the views draw their last state."""
        self.end_record(ok)
        if self.inner is not None:
            self.inner.on_end(ok)

    def end_record(self, ok: bool) -> None:
        """End the record and its views, not ``inner`` (a launch that failed before it started told it nothing)."""
        with self.lock:
            super().on_end(ok)
            for handle in self._logs.values():
                handle.close()
            views, self._views = self._views, []
            for view in views:
                try:
                    view.on_end(ok)
                except Exception:  # noqa: BLE001 - one broken view must not hide the others' end
                    continue

    # ------------------------------------------------------------------ output
    def _keep(self, rank: int, line: str) -> None:
        kept = self._kept.setdefault(rank, deque())
        kept.append(line)
        self._kept_chars[rank] = self._kept_chars.get(rank, 0) + len(line) + 1
        log = self._logs.get(rank)
        if log is not None and not log.closed:
            log.write(line + "\n")
            log.flush()  # readable while the run goes on
        while self._kept_chars[rank] > OUTPUT_CHARS and len(kept) > 1:
            if log is None:
                log = self._open_log(rank, kept)  # the whole output so far: the file is complete from here on
            dropped = kept.popleft()
            self._kept_chars[rank] -= len(dropped) + 1
            self._dropped[rank] = self._dropped.get(rank, 0) + 1

    def _open_log(self, rank: int, kept: deque[str]) -> IO[str]:
        if self._folder is None:
            self._folder = Path(tempfile.mkdtemp(prefix="nbaccel-run-"))  # 0700: the user's own
        handle = self._logs[rank] = open(  # noqa: SIM115 - kept open across writes, closed at the run's end
            self._folder / f"rank{rank}.log", "a", encoding="utf-8", errors="replace")
        handle.write("".join(line + "\n" for line in kept))
        handle.flush()
        return handle

    def output(self, rank: int) -> RankText:
        """What ``rank`` printed: the last :data:`OUTPUT_CHARS` characters, naming the log file of the rest."""
        with self.lock:
            kept = "".join(line + "\n" for line in self._kept.get(rank, ()))
            log = self._logs.get(rank)
            dropped = self._dropped.get(rank, 0)
        if log is not None:
            kept = (f"[... {dropped:,} earlier line{'s' if dropped != 1 else ''} of rank {rank} are not kept here; "
                    f"every line is in {log.name}]\n") + kept
        text = RankText(kept)
        text.log_file = log.name if log is not None else None
        return text

    def ranks(self) -> list[int]:
        """The ranks of the run."""
        with self.lock:
            return list(self.records)
