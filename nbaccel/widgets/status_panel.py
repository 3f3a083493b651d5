"""The live status of a launch: one row per rank (state, elapsed time, last line), full output, live chart.

:class:`LaunchStatus` keeps the per-rank record and what workers pass to ``accelerator.log``, and
renders them as plain text; it implements :class:`~nbaccel.launch.events.LaunchObserver`.
:class:`StatusPanel` shows the same record as an ipywidgets panel redrawn a few times a second by
a small ticker thread, with the logged metrics as a live chart
(:class:`~nbaccel.widgets.live_chart.LiveChart`, at most one redraw per 0.5 s); the launch's own
callbacks only record (microseconds), so following a launch never slows it down. :class:`TextStatus`
prints a compact table of the metrics every few seconds and the record once the launch ends, for
terminals and logs. :func:`status_observer` picks one.
"""

from __future__ import annotations

import base64
import html
import sys
import threading
import time
from collections import deque
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from nbaccel.hardware import in_colab, in_notebook
from nbaccel.launch.events import LaunchObserver, RankState
from nbaccel.tracking.history import metrics_table
from nbaccel.widgets import import_widgets, set_titles, widget_bundle, widgets_available
from nbaccel.widgets.live_chart import LiveChart
from nbaccel.widgets.status_html import STATE_COLORS, output_html, rank_table_html

__all__ = ["LaunchStatus", "RankRecord", "StatusPanel", "TextStatus", "status_observer"]

_KEEP_LINES = 2000  # per rank, for the collapsible full output
_SHOWN_LINES = 400  # redrawn while running; everything kept is shown once the launch ends


@dataclass
class RankRecord:
    """What the panel knows about one rank."""

    rank: int
    state: RankState = "starting"
    started: float | None = None
    ended: float | None = None
    last_line: str = ""
    progress: str = ""
    lines: deque[str] = field(default_factory=lambda: deque(maxlen=_KEEP_LINES))
    line_count: int = 0

    def elapsed(self, now: float, launched: float | None) -> float:
        """Seconds since the rank started (or since the launch, while it is starting)."""
        begin = self.started if self.started is not None else launched
        if begin is None:
            return 0.0
        return max(0.0, (self.ended if self.ended is not None else now) - begin)


class LaunchStatus(LaunchObserver):
    """The per-rank record of one launch, as plain text; a :class:`LaunchObserver`.

    Args:
        num_processes: the ranks expected (``on_launch`` may correct it).
        title: the first line of the report.

    Example:
        >>> status = LaunchStatus(2)
        >>> status.on_launch([0, 1], "fork"); status.on_state(0, "running")
        >>> status.on_output(0, "stdout", "epoch 1"); status.records[0].last_line
        'epoch 1'
    """

    def __init__(self, num_processes: int, title: str = "nbaccel launch") -> None:
        self.title = title
        self.start_method = ""
        self.launched: float | None = None
        self.ended: float | None = None
        self.ok: bool | None = None
        self.records: dict[int, RankRecord] = {r: RankRecord(r) for r in range(num_processes)}
        self.metrics: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ observer
    def on_launch(self, ranks: Sequence[int], start_method: str) -> None:
        """The workers are about to start."""
        self.launched = time.monotonic()
        self.start_method = start_method
        self.records = {r: self.records.get(r) or RankRecord(r) for r in ranks}

    def on_state(self, rank: int, state: RankState) -> None:
        """Rank ``rank`` moved to ``state``."""
        record = self.records.setdefault(rank, RankRecord(rank))
        now = time.monotonic()
        if state == "running" and record.started is None:
            record.started = now
        elif state in ("finished", "failed", "stopped") and record.ended is None:
            record.ended = now
        record.state = state

    def on_output(self, rank: int, stream: Literal["stdout", "stderr"], line: str) -> None:
        """Rank ``rank`` printed ``line``."""
        record = self.records.get(rank)
        if record is None:
            record = self.records.setdefault(rank, RankRecord(rank))
        record.lines.append(line)
        record.line_count += 1
        if line.strip():
            record.last_line = line

    def on_progress(self, rank: int, stream: Literal["stdout", "stderr"], text: str) -> None:
        """Rank ``rank`` redrew its progress bar; ``text`` is how it reads now."""
        self.records.setdefault(rank, RankRecord(rank)).progress = text

    def on_log(self, rank: int, record: dict[str, Any]) -> None:
        """Rank ``rank`` logged ``record`` (``accelerator.log``, main process)."""
        self.metrics.append(record)

    def on_end(self, ok: bool) -> None:
        """Every worker is gone."""
        self.ended = time.monotonic()
        self.ok = ok
        for record in self.records.values():
            if record.state in ("starting", "running"):
                record.state = "stopped"
            if record.ended is None:
                record.ended = self.ended

    # ------------------------------------------------------------------ views
    def overall(self) -> str:
        """``"starting"``, ``"running"``, ``"finished"``, ``"failed"`` or ``"stopped"``."""
        states = {r.state for r in self.records.values()}
        if self.ok is None:
            return "running" if self.launched is not None and states - {"starting"} else "starting"
        if self.ok:
            return "finished"
        return "failed" if "failed" in states else "stopped"

    def total_elapsed(self) -> float:
        """Seconds since the launch began (until it ended)."""
        if self.launched is None:
            return 0.0
        return (self.ended if self.ended is not None else time.monotonic()) - self.launched

    def text(self) -> str:
        """The status as plain text, one line per rank."""
        now = time.monotonic()
        method = f", {self.start_method}" if self.start_method else ""
        lines = [f"{self.title}{method}: {self.overall()} after {self.total_elapsed():.1f} s"]
        for record in self.records.values():
            last = record.last_line if len(record.last_line) <= 100 else record.last_line[:97] + "..."
            lines.append(f"  [rank{record.rank}] {record.state:<8} {record.elapsed(now, self.launched):6.1f} s"
                         f"  {record.line_count} lines  last: {last}")
            if record.progress:
                lines.append(f"           progress: {record.progress.strip()[:100]}")
        table = metrics_table(self.metrics)
        if table:
            lines.append(f"  logged ({len(self.metrics)} records, last {min(5, len(self.metrics))}):")
            lines += ["    " + row for row in table.splitlines()]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.text()


class TextStatus(LaunchStatus):
    """Prints the per-rank summary once the launch ends, and the logged metrics every few seconds.

    For terminals, logs and frontends without ipywidgets.

    Args:
        num_processes: the ranks expected.
        title: the first line of the report.
        metrics_interval: least seconds between two printed tables of logged metrics.

    Example:
        >>> status = TextStatus(1)
        >>> status.on_launch([0], "fork"); status.on_end(True)  # doctest: +ELLIPSIS
        nbaccel launch, fork: finished after ...
    """

    def __init__(self, num_processes: int, title: str = "nbaccel launch", *, metrics_interval: float = 5.0) -> None:
        super().__init__(num_processes, title)
        self.metrics_interval = metrics_interval
        self._printed_at: float | None = None

    def on_log(self, rank: int, record: dict[str, Any]) -> None:
        """Record it; print the latest rows when ``metrics_interval`` has passed since the last table."""
        super().on_log(rank, record)
        now = time.monotonic()
        if self._printed_at is None:
            self._printed_at = now  # the first table after one interval, not on the first record
        elif now - self._printed_at >= self.metrics_interval:
            self._printed_at = now
            print(f"[logged, {len(self.metrics)} records]\n{metrics_table(self.metrics, rows=3)}", flush=True)

    def on_end(self, ok: bool) -> None:
        """Every worker is gone: print the summary."""
        super().on_end(ok)
        print(self.text(), file=sys.stdout, flush=True)


class StatusPanel(LaunchStatus):
    """The live status as an ipywidgets panel; its plain-text form is :meth:`text`.

    Args:
        num_processes: the ranks expected.
        title: the panel's heading.
        interval: seconds between redraws by the ticker (events in between are batched).
        stream_ranks: the ranks whose lines the cell's own stream shows (``None``: every rank, as
            a launch without ``output_ranks`` does). Their lines are not repeated in the panel:
            it has a collapsible output section only for the other ranks, and only once a rank
            printed something, so each line appears once in the cell and a silent launch has none.

    Raises:
        MissingDependencyError: ipywidgets is not installed.

    Example:
        >>> panel = StatusPanel(2)
        >>> notebook_launcher(train, num_processes=2, observer=panel)  # doctest: +SKIP
    """

    shows_progress = True  # each rank's bar is drawn here, so the cell's stream gets only final lines

    def __init__(self, num_processes: int, title: str = "nbaccel launch", *, interval: float = 0.25,
                 chart_interval: float = 0.5, stream_ranks: Container[int] | None = frozenset()) -> None:
        super().__init__(num_processes, title)
        widgets = import_widgets("the launch status panel")
        self.interval = interval
        self._lock = threading.Lock()
        self._last_draw = 0.0
        self._dirty = False
        self._ticker: threading.Thread | None = None
        self._done = threading.Event()
        self._handle: Any = None
        self._drawn_lines: dict[int, int] = {}
        self._stream_ranks = stream_ranks
        self._sections: dict[int, Any] = {}  # rank -> its output section (shown once it has lines)
        self._shown_sections: list[int] = []
        self._heading = widgets.HTML()
        self._table = widgets.HTML()
        self._outputs = widgets.Accordion(children=[], selected_index=None)
        self.chart = LiveChart(widgets, min_interval=chart_interval)
        self._box = widgets.VBox([self._heading, self._table, self.chart.view, self._outputs])
        self._box.add_class("nbaccel-status")
        self._widgets = widgets
        self._build_outputs()
        self.draw()

    def _build_outputs(self) -> None:
        self._sections = {}
        for record in self.records.values():
            child = self._widgets.HTML()
            child.add_class(f"nbaccel-output-rank{record.rank}")
            self._sections[record.rank] = child
        self._drawn_lines = {}
        self._shown_sections = []
        self._outputs.children = []

    def _sectioned(self, record: RankRecord) -> bool:
        """Whether ``record``'s rank gets a section: it printed, and the cell's stream does not show it."""
        streamed = self._stream_ranks is None or record.rank in self._stream_ranks
        return record.line_count > 0 and not streamed

    # ------------------------------------------------------------------ observer
    def on_launch(self, ranks: Sequence[int], start_method: str) -> None:
        """Show the panel and start the ticker that keeps elapsed times fresh."""
        known = list(self.records)
        super().on_launch(ranks, start_method)
        if list(self.records) != known:
            self._build_outputs()
        self.draw()
        from IPython.display import display

        self._handle = display(self, display_id=True)
        self._ticker = threading.Thread(target=self._tick, name="nbaccel-status", daemon=True)
        self._ticker.start()

    def on_state(self, rank: int, state: RankState) -> None:
        """Record the change; the ticker draws it within ``interval``."""
        super().on_state(rank, state)
        self._dirty = True

    def on_output(self, rank: int, stream: Literal["stdout", "stderr"], line: str) -> None:
        """Record the line; the ticker draws it within ``interval``."""
        super().on_output(rank, stream, line)
        self._dirty = True

    def on_progress(self, rank: int, stream: Literal["stdout", "stderr"], text: str) -> None:
        """Record the bar; the ticker draws it within ``interval``."""
        super().on_progress(rank, stream, text)
        self._dirty = True

    def on_log(self, rank: int, record: dict[str, Any]) -> None:
        """Record it; the ticker redraws the chart (at most every ``chart_interval``)."""
        super().on_log(rank, record)
        self._dirty = True

    def on_end(self, ok: bool) -> None:
        """Stop the ticker, draw the final state with every rank's full output and the whole chart."""
        super().on_end(ok)
        self._done.set()
        if self._ticker is not None:
            self._ticker.join(timeout=1.0)
        self.draw(final=True)
        self.chart.update(list(self.metrics), force=True)
        if self._handle is not None:
            self._handle.update(self)  # refreshes the text/plain form saved in the notebook

    def _tick(self) -> None:
        # Drawing happens here, off the supervisor's thread: the launch's own callbacks only record.
        while not self._done.wait(self.interval):
            if self._dirty or time.monotonic() - self._last_draw >= 1.0:  # elapsed times move too
                self._dirty = False
                self.draw()
            # Only once every worker has started: drawing imports matplotlib, and a fork in the middle
            # of an import would leave that module's lock held in the child.
            started = all(r.state != "starting" for r in self.records.values())
            if started and len(self.metrics) != self.chart.drawn_count:
                self.chart.update(list(self.metrics))  # rate-limited inside

    # ------------------------------------------------------------------ drawing
    def draw(self, final: bool = False) -> None:
        """Redraw the heading, the rank table and each rank's output (the last lines; all when ``final``)."""
        with self._lock:
            self._last_draw = time.monotonic()
            overall = self.overall()
            method = f" · {html.escape(self.start_method)}" if self.start_method else ""
            self._heading.value = (f"<b>{html.escape(self.title)}</b>{method} · "
                                   f"<span style='color:{STATE_COLORS[overall]}'>{overall}</span> · "
                                   f"{self.total_elapsed():.1f} s")
            self._table.value = self._table_html()
            # Every rank's section is kept current, not only the open one: opening a section is a
            # message the kernel reads only after the cell ends, so it must already hold the text.
            # Only ranks with new lines are sent.
            records = [r for r in list(self.records.values()) if self._sectioned(r)]
            for record in records:
                child = self._sections[record.rank]
                if final or self._drawn_lines.get(record.rank) != record.line_count:
                    self._drawn_lines[record.rank] = record.line_count
                    child.value = output_html(record, None if final else _SHOWN_LINES)
            if [r.rank for r in records] != self._shown_sections:
                self._shown_sections = [r.rank for r in records]
                self._outputs.children = [self._sections[r.rank] for r in records]
            set_titles(self._outputs, [f"rank {r.rank} output ({r.line_count} line{'s' if r.line_count != 1 else ''})"
                                       for r in records])

    def _table_html(self) -> str:
        return rank_table_html(list(self.records.values()), self.launched, time.monotonic())

    # ------------------------------------------------------------------ display
    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        bundle = widget_bundle(self._box, self.text())
        if self.ok is not None and self.chart.png:  # ended: the chart stays in the saved notebook as an image
            bundle["image/png"] = base64.b64encode(self.chart.png).decode("ascii")
        return bundle


def status_observer(num_processes: int, *, prefer: Literal["widget", "text"] = "widget",
                    title: str = "nbaccel launch", stream_ranks: Container[int] | None = None) -> LaunchStatus:
    """The status observer for a launch: a widget panel in notebooks, else a text summary.

    ``stream_ranks``: the ranks whose lines the cell's stream shows (``None``: all); the panel
    repeats none of them (see :class:`StatusPanel`).

    Example:
        >>> observer = status_observer(2, prefer="text")
        >>> type(observer).__name__
        'TextStatus'
    """
    if prefer == "widget" and widgets_available() and (in_notebook() or in_colab()):
        return StatusPanel(num_processes, title, stream_ranks=stream_ranks)
    return TextStatus(num_processes, title)
