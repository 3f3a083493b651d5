"""Relaying workers' output to the caller: whole lines, labelled with the rank, as written.

Each worker's fd 1 and fd 2 are pipes the supervisor reads; bytes are split into lines here and
written to the caller's ``sys.stdout`` / ``sys.stderr`` with a ``[rankN]: `` label. A line that is
being redrawn with ``\\r`` (a progress bar) is shown live and redrawn in place. What a worker
displays (rich output) is queued by :meth:`OutputRelay.queue_display` and published where its mark
falls in the rank's stdout: after the text printed before it, before the text printed after.
"""

from __future__ import annotations

import codecs
import sys
from collections import deque
from collections.abc import Callable, Collection, Container, Mapping
from typing import Any, Literal, TextIO

from nbaccel.launch.frames import DISPLAY_MARK

__all__ = ["DisplayKind", "OutputRelay"]

Stream = Literal["stdout", "stderr"]
DisplayKind = Literal["display", "clear_output"]
_MARK = DISPLAY_MARK.decode("ascii")


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
        self._on_line = on_line
        self._on_progress = on_progress
        self._labels = dict(labels or {})
        self._decoders: dict[tuple[int, Stream], codecs.IncrementalDecoder] = {}
        self._pending: dict[tuple[int, Stream], str] = {}
        self._open: tuple[int, Stream] | None = None  # a redrawn line without its newline yet
        self.last_line: dict[int, str] = {}
        self.captured: dict[int, list[str]] = {}
        self.capturing: set[int] = set()

    @staticmethod
    def _target(stream: Stream) -> TextIO:
        return sys.stdout if stream == "stdout" else sys.stderr

    def _label(self, rank: int) -> str:
        return f"[{self._labels[rank]}]: " if rank in self._labels else f"[rank{rank}]: "

    def _close_open_line(self, key: tuple[int, Stream] | None = None) -> None:
        if self._open is not None and self._open != key:
            self._target(self._open[1]).write("\n")
            self._open = None

    def feed(self, rank: int, stream: Stream, data: bytes) -> None:
        """Add bytes read from ``rank``'s ``stream``; write out what completes a line."""
        key = (rank, stream)
        decoder = self._decoders.get(key)
        if decoder is None:
            decoder = self._decoders[key] = codecs.getincrementaldecoder("utf-8")("replace")
        text = self._pending.get(key, "") + decoder.decode(data)
        while _MARK in text:  # a display: the text before it is out first, even a partial line
            before, text = text.split(_MARK, 1)
            self._lines(rank, stream, before)
            rest = self._pending.pop(key, "")
            if "\r" in rest:
                text = rest + text  # a bar being redrawn goes on after the display
            elif rest:
                self._emit(rank, stream, rest)
            self._publish_display(rank)
        self._lines(rank, stream, text)

    def _lines(self, rank: int, stream: Stream, text: str) -> None:
        key = (rank, stream)
        *lines, rest = text.split("\n")
        for line in lines:
            self._emit(rank, stream, line)
        self._pending[key] = rest
        if "\r" in rest:
            self._redraw(rank, stream, rest)

    def _visible(self, rank: int) -> bool:
        return self._show is None or rank in self._show or rank in self._labels

    def _redraw(self, rank: int, stream: Stream, partial: str) -> None:
        current = partial.rstrip("\r").rsplit("\r", 1)[-1]
        if self._on_progress is not None and current and rank not in self._labels:
            self._on_progress(rank, stream, current)
        if not self._visible(rank) or not current or not self._show_redraws:
            return
        key = (rank, stream)
        self._close_open_line(key)
        target = self._target(stream)
        target.write("\r" + self._label(rank) + current)
        target.flush()
        self._open = key

    def _emit(self, rank: int, stream: Stream, line: str) -> None:
        key = (rank, stream)
        if "\r" in line:
            line = line.rstrip("\r").rsplit("\r", 1)[-1]
            if self._on_progress is not None and line and rank not in self._labels:
                self._on_progress(rank, stream, line)  # the bar's last state, now ended by its newline
        self.last_line[rank] = line
        if rank in self.capturing:
            self.captured.setdefault(rank, []).append(line)
        if self._on_line is not None and rank not in self._labels:
            self._on_line(rank, stream, line)
        if not self._visible(rank):
            return
        target = self._target(stream)
        if self._open == key:
            target.write("\r" + self._label(rank) + line + "\n")
            self._open = None
        else:
            self._close_open_line()
            target.write(self._label(rank) + line + "\n")
        target.flush()

    def flush_rank(self, rank: int) -> None:
        """Write out what ``rank`` left without a final newline (call once it has exited)."""
        for stream in ("stdout", "stderr"):
            key = (rank, stream)
            decoder = self._decoders.get(key)
            rest = self._pending.pop(key, "") + (decoder.decode(b"", final=True) if decoder else "")
            if rest:
                self._emit(rank, stream, rest)  # type: ignore[arg-type]
        self._close_open_line()

    def queue_display(self, rank: int, kind: DisplayKind, body: dict[str, Any]) -> None:
        """Hold what ``rank`` displayed until its mark in the rank's stdout (see :mod:`nbaccel.launch.frames`)."""
        self._displays.setdefault(rank, deque()).append((kind, body))

    def _publish_display(self, rank: int) -> None:
        queued = self._displays.get(rank)
        if not queued:
            return  # a mark without its frame: the worker died between the two writes
        kind, body = queued.popleft()
        if self._on_display is None or rank not in self._display_ranks:
            return
        self._close_open_line()
        for target in (sys.stdout, sys.stderr):
            target.flush()
        self._on_display(rank, kind, body, len(self._display_ranks) > 1)
