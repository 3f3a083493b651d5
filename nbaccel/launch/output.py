"""Relaying workers' output to the caller: whole lines, labelled with the rank, as written.

Each worker's fd 1 and fd 2 are pipes the supervisor reads; bytes are split into lines here and
written to the caller's streams with a ``[rankN]: `` label. A line redrawn with ``\\r`` (a progress
bar) is shown live, redrawn in place, and on stdout. A worker's display (queued by
:meth:`OutputRelay.queue_display`) is published where its mark falls in the rank's stdout.

What always holds, whatever a rank writes: the work and memory are linear in the bytes read. A
redrawn line keeps only its last state; a line longer than
:data:`~nbaccel.launch.output_log.MAX_LINE_CHARS` is cut in the cell and written whole to the
rank's log file (:mod:`nbaccel.launch.output_log`). Writes are flushed at most
:data:`FLUSH_INTERVAL` apart (a Jupyter kernel sends one message per flush: a flush per line made
6,000 lines take 81 s to render), and always when a rank ends, a display is published, or
:meth:`OutputRelay.flush` is called.

A run supervised on another thread (:mod:`nbaccel.runs`) must not write to ``sys.stdout`` (in a
kernel it belongs to whichever cell executes): it calls :func:`route_output` first.
"""

from __future__ import annotations

import codecs
import contextlib
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Container, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TextIO

from nbaccel.launch.frames import DISPLAY_MARK
from nbaccel.launch.output_log import MAX_LINE_CHARS, RankLogs

__all__ = ["FLUSH_INTERVAL", "DisplayKind", "OutputRelay", "OutputRoute", "route_output"]

Stream = Literal["stdout", "stderr"]
DisplayKind = Literal["display", "clear_output"]
_MARK = DISPLAY_MARK.decode("ascii")
FLUSH_INTERVAL = 0.2
"""Seconds between flushes of the caller's streams while lines keep coming (at most 5 a second).

A Jupyter kernel sends one message per flush, plus one when its own timer (0.2 s after a write
that follows a flush) fires: about 10 messages a second at most, whatever the ranks write
(measured: 2 ranks redrawing 50 MB of bars sent 41 a second with a 0.1 s interval)."""


@dataclass(frozen=True)
class OutputRoute:
    """Where the relays of one thread write instead of the caller's streams (see :func:`route_output`).

    Attributes:
        stdout: takes what would go to ``sys.stdout``.
        stderr: takes what would go to ``sys.stderr``.
        on_display: takes every display of a shown rank, as ``OutputRelay``'s ``on_display`` would.
    """

    stdout: TextIO
    stderr: TextIO
    on_display: Callable[[int, DisplayKind, dict[str, Any], bool], None] | None = None


_routes = threading.local()


@contextlib.contextmanager
def route_output(route: OutputRoute) -> Iterator[None]:
    """While the block runs, relays on this thread write to ``route``, not to ``sys.stdout``/``sys.stderr``.

    Example:
        >>> import io
        >>> sink = io.StringIO()
        >>> with route_output(OutputRoute(sink, sink)):
        ...     relay = OutputRelay(); relay.feed(0, "stdout", b"hi\\n"); relay.flush()
        >>> sink.getvalue()
        '[rank0]: hi\\n'
    """
    previous = getattr(_routes, "route", None)
    _routes.route = route
    try:
        yield
    finally:
        _routes.route = previous


def _route() -> OutputRoute | None:
    return getattr(_routes, "route", None)


@dataclass
class _Cut:
    """A line past :data:`MAX_LINE_CHARS` still being written: its head for the cell, its length so far."""

    head: str
    length: int


@dataclass
class _LineState:
    """One rank's stream: its decoder, its unfinished line (bounded), and a cut line in progress."""

    decoder: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))
    pending: str = ""
    cut: _Cut | None = None


def _last_state(text: str) -> str:
    """What a line redrawn with ``\\r`` shows now: its last non-empty segment."""
    for segment in reversed(text.split("\r")):
        if segment:
            return segment
    return ""


class OutputRelay:
    """Turns raw bytes from ranks into labelled lines.

    Args:
        show: the ranks whose output is written to the caller's streams (``None``: all).
        on_line: called with ``(rank, stream, line)`` for every complete line of every rank.
        on_progress: called with ``(rank, stream, text)`` each time a rank redraws a line with ``\\r``
            (a progress bar such as tqdm's), with the line as it now reads.
        show_redraws: write the redraws to the caller's streams too (``False`` when something else,
            the widget status panel, shows the bars: then only each bar's final line is written).
        labels: fixed labels for pseudo-ranks that are not workers (torch_xla's host process:
            ``{-1: "xla"}``); their output is always shown and never passed to ``on_line``.
        on_display: called with ``(rank, kind, body, labelled)`` for a display of a rank in
            ``display_ranks`` (see :mod:`nbaccel.launch.rich_output`); ``labelled`` when there are several.
        display_ranks: the ranks whose displays are published (rank 0's alone by default).

    Ranks in :attr:`capturing` also have their lines kept in :attr:`captured` (for stack dumps).
    """

    def __init__(self, show: Container[int] | None = None,
                 on_line: Callable[[int, Stream, str], None] | None = None,
                 labels: Mapping[int, str] | None = None,
                 on_display: Callable[[int, DisplayKind, dict[str, Any], bool], None] | None = None,
                 display_ranks: Collection[int] = (0,),
                 on_progress: Callable[[int, Stream, str], None] | None = None,
                 show_redraws: bool = True) -> None:
        self._show = show
        self._show_redraws = show_redraws
        self._on_display = on_display
        self._display_ranks = frozenset(display_ranks)
        self._displays: dict[int, deque[tuple[DisplayKind, dict[str, Any]]]] = {}
        self._early_marks: dict[int, int] = {}  # marks that came before their frame, per rank
        self._on_line = on_line
        self._on_progress = on_progress
        self._labels = dict(labels or {})
        self._states: dict[tuple[int, Stream], _LineState] = {}
        self._open: tuple[int, Stream] | None = None  # a redrawn line without its newline yet
        self._outbox: list[tuple[Stream, str]] = []
        self._redrawn_at: dict[tuple[int, Stream], float] = {}
        self._flushed_at = 0.0
        self._unflushed = False
        self.logs = RankLogs()
        self.last_line: dict[int, str] = {}
        self.captured: dict[int, list[str]] = {}
        self.capturing: set[int] = set()

    # ------------------------------------------------------------------ writing out
    def _put(self, stream: Stream, text: str) -> None:
        self._outbox.append((stream, text))

    def _write_outbox(self) -> None:
        run: list[str] = []
        current: Stream | None = None
        for stream, text in self._outbox:
            if stream != current and run:
                self._target(current).write("".join(run))  # type: ignore[arg-type]  # set once run holds text
                run = []
            current = stream
            run.append(text)
        if run:
            self._target(current).write("".join(run))  # type: ignore[arg-type]  # set once run holds text
        self._outbox.clear()

    def _send(self) -> None:
        """Write what is waiting; flush the streams unless they were flushed under FLUSH_INTERVAL ago."""
        if self._outbox:
            self._write_outbox()
            self._unflushed = True
        self.tick()

    def tick(self) -> None:
        """Flush what was written since the last flush, if that was at least :data:`FLUSH_INTERVAL` ago.

        The launch's loop calls it between reads, so a line is never held longer than that.
        """
        if self._unflushed and time.monotonic() - self._flushed_at >= FLUSH_INTERVAL:
            self.flush()

    def flush(self) -> None:
        """Write and flush everything now (the end of a run, a display, a rank's exit)."""
        self._write_outbox()
        for target in (self._target("stdout"), self._target("stderr")):
            target.flush()
        self._unflushed = False
        self._flushed_at = time.monotonic()

    @staticmethod
    def _target(stream: Stream) -> TextIO:
        route = _route()
        if route is not None:
            return route.stdout if stream == "stdout" else route.stderr
        return sys.stdout if stream == "stdout" else sys.stderr

    def _label(self, rank: int) -> str:
        return f"[{self._labels[rank]}]: " if rank in self._labels else f"[rank{rank}]: "

    def _close_open_line(self, key: tuple[int, Stream] | None = None) -> None:
        if self._open is not None and self._open != key:
            self._put("stdout", "\n")  # redraws are shown on stdout
            self._open = None

    # ------------------------------------------------------------------ reading in
    def _state(self, rank: int, stream: Stream) -> _LineState:
        state = self._states.get((rank, stream))
        if state is None:
            state = self._states[(rank, stream)] = _LineState()
        return state

    def feed(self, rank: int, stream: Stream, data: bytes) -> None:
        """Add bytes read from ``rank``'s ``stream``; write out what completes a line."""
        state = self._state(rank, stream)
        text = state.decoder.decode(data)
        while _MARK in text:  # a display: the text before it is out first, even a partial line
            before, text = text.split(_MARK, 1)
            self._lines(rank, stream, before)
            if state.cut is not None:
                self._end_cut(rank, stream, state)
            elif state.pending and "\r" not in state.pending:  # a bar being redrawn goes on after it
                self._emit(rank, stream, state.pending)
                state.pending = ""
            self._publish_display(rank)
        self._lines(rank, stream, text)
        self._send()

    def _lines(self, rank: int, stream: Stream, text: str) -> None:
        state = self._state(rank, stream)
        if state.cut is not None:  # the rest of a cut line goes to the log as it comes
            end = text.find("\n")
            self.logs.append(rank, text if end < 0 else text[:end])
            state.cut.length += len(text) if end < 0 else end
            if end < 0:
                return
            self._end_cut(rank, stream, state)
            text = text[end + 1:]
        text, state.pending = state.pending + text, ""  # the pending part is bounded: this stays linear
        *lines, rest = text.split("\n")
        for line in lines:
            self._emit(rank, stream, line)
        if "\r" in rest:  # keep only what the bar shows now, and whether a redraw is due
            current = _last_state(rest)[:MAX_LINE_CHARS]
            state.pending = "\r" + current + ("\r" if rest.endswith("\r") else "")
            self._redraw(rank, stream, current)
        elif len(rest) > MAX_LINE_CHARS:
            state.cut = _Cut(head=rest[:MAX_LINE_CHARS], length=len(rest))
            self.logs.append(rank, rest)
        else:
            state.pending = rest

    def _end_cut(self, rank: int, stream: Stream, state: _LineState) -> None:
        cut, state.cut = state.cut, None
        path = self.logs.append(rank, "\n")
        self._deliver(rank, stream, _shortened(cut.head, cut.length, path), bar=False)  # type: ignore[union-attr]  # called only while a cut is open

    def _visible(self, rank: int) -> bool:
        return self._show is None or rank in self._show or rank in self._labels

    def _redraw(self, rank: int, stream: Stream, current: str) -> None:
        if self._on_progress is not None and current and rank not in self._labels:
            self._on_progress(rank, stream, current)
        if not self._visible(rank) or not current or not self._show_redraws:
            return
        key = (rank, stream)
        now = time.monotonic()
        if self._open == key and now - self._redrawn_at.get(key, 0.0) < FLUSH_INTERVAL:
            return  # shown at most once a flush: the state is kept, and its final line always comes
        self._redrawn_at[key] = now
        self._close_open_line(key)
        self._put("stdout", "\r" + self._label(rank) + current)
        self._open = key

    def _emit(self, rank: int, stream: Stream, line: str) -> None:
        line = _without_torchs_label(rank, line)
        bar = "\r" in line
        if bar:
            line = _last_state(line)
            if self._on_progress is not None and line and rank not in self._labels:
                self._on_progress(rank, stream, line)  # the bar's last state, now ended by its newline
        if len(line) > MAX_LINE_CHARS:
            path = self.logs.append(rank, line + "\n")
            line = _shortened(line[:MAX_LINE_CHARS], len(line), path)
        self._deliver(rank, stream, line, bar)

    def _deliver(self, rank: int, stream: Stream, line: str, bar: bool) -> None:
        key = (rank, stream)
        self.last_line[rank] = line
        if rank in self.capturing:
            self.captured.setdefault(rank, []).append(line)
        if self._on_line is not None and rank not in self._labels:
            self._on_line(rank, stream, line)
        if not self._visible(rank):
            return
        if self._open == key and bar:
            self._put("stdout", "\r" + self._label(rank) + line + "\n")
            self._open = None
        else:
            self._close_open_line()
            self._put("stdout" if bar else stream, self._label(rank) + line + "\n")

    def flush_rank(self, rank: int) -> None:
        """Write out what ``rank`` left without a final newline, and what it displayed whose mark never came
        (call once it has exited)."""
        for stream in ("stdout", "stderr"):
            state = self._states.get((rank, stream))
            if state is None:
                continue
            rest = state.decoder.decode(b"", final=True)
            if state.cut is not None:
                self._lines(rank, stream, rest)
                if state.cut is not None:
                    self._end_cut(rank, stream, state)
            elif state.pending + rest:
                self._emit(rank, stream, state.pending + rest)
            del self._states[(rank, stream)]
        while self._displays.get(rank):  # frames whose mark never came: the rank ended between the two writes
            self._publish_display(rank)
        self._close_open_line()
        self.flush()

    def queue_display(self, rank: int, kind: DisplayKind, body: dict[str, Any]) -> None:
        """Hold what ``rank`` displayed until its mark in the rank's stdout (see :mod:`nbaccel.launch.frames`).

        A frame whose mark already came (a transport that reordered them) is shown now: late, not lost.
        """
        self._displays.setdefault(rank, deque()).append((kind, body))
        if self._early_marks.get(rank, 0) > 0:
            self._early_marks[rank] -= 1
            self._publish_display(rank)

    def _publish_display(self, rank: int) -> None:
        queued = self._displays.get(rank)
        if not queued:
            self._early_marks[rank] = self._early_marks.get(rank, 0) + 1
            return
        kind, body = queued.popleft()
        route = _route()
        on_display = route.on_display if route is not None else self._on_display
        if on_display is None or rank not in self._display_ranks:
            return
        self._close_open_line()
        self.flush()
        on_display(rank, kind, body, len(self._display_ranks) > 1)


def _without_torchs_label(rank: int, line: str) -> str:
    """``line`` without the ``[rankN]:`` torch itself puts before its C++ log lines and uncaught
    exceptions once a process group exists, so the relay's own label is not doubled.

    Example:
        >>> _without_torchs_label(0, "[rank0]:[W1205 reducer.cpp:1529] Warning: ...")
        '[W1205 reducer.cpp:1529] Warning: ...'
    """
    own = f"[rank{rank}]:"
    if not line.startswith(own):
        return line
    rest = line[len(own):]
    return rest[1:] if rest.startswith(" ") else rest


def _shortened(head: str, length: int, path: str) -> str:
    return f"{head} [... line cut at {len(head):,} of {length:,} characters; the whole line is in {path}]"
