"""Showing a run in the current cell: its status panel, its output so far and live chart, kept live.

:func:`show_run` is what ``run.show()`` and ``%accel_runs show`` call. In a notebook with
ipywidgets it displays a :class:`~nbaccel.widgets.status_panel.StatusPanel` filled from the run's
record (states, elapsed times, logged metrics) and, under it, the output so far (every rank's
latest lines as the cell would show them, and what the ranks displayed); both keep updating from
the run's own thread until it ends. Widget updates travel by widget id, not by cell, so the view
stays live in the cell that showed it, whatever cell executes meanwhile, and a view shown after
a browser reload works the same. Elsewhere (a terminal, no ipywidgets) the status and output so
far are printed once.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import threading
from collections import deque
from typing import Any, Literal

from nbaccel.hardware import in_colab, in_notebook
from nbaccel.launch.events import RankState
from nbaccel.launch.rich_output import label_bundle
from nbaccel.runs.record import KEPT_DISPLAYS, TAIL_LINES, RunRecord
from nbaccel.widgets import import_widgets, widget_bundle, widgets_available
from nbaccel.widgets.status_panel import StatusPanel

__all__ = ["RunOutputView", "can_show_live", "show_run"]

Stream = Literal["stdout", "stderr"]
_IMAGES = ("image/png", "image/jpeg")


def _bundle(body: dict[str, Any], rank: int, labelled: bool) -> dict[str, Any]:
    data = dict(body.get("data", {}))
    if labelled:
        return label_bundle(data, rank)
    for mime in _IMAGES:  # a rank's formatter gives raw bytes; an output widget carries base64 text
        if isinstance(data.get(mime), (bytes, bytearray)):
            data[mime] = base64.b64encode(data[mime]).decode("ascii")
    return data


class RunOutputView:
    """The live part of a shown run: a status panel, and the output so far under it.

    Built by :meth:`RunRecord.attach` under the record's lock, so it starts from the record as it
    is and then gets every later event from the run's thread. Only records there; a ticker thread
    redraws the output at most every ``interval`` seconds.
    """

    def __init__(self, record: RunRecord, interval: float = 0.25) -> None:
        widgets = import_widgets("the live view of a run")
        self.interval = interval
        self.panel = StatusPanel(len(record.records), record.title, stream_ranks=None)
        self.panel.on_launch(list(record.records), record.start_method)  # displays it in the current cell
        self.panel.launched = record.launched if record.launched is not None else self.panel.launched
        self.panel.records = {r: dataclasses.replace(rec, lines=deque(maxlen=1)) for r, rec in record.records.items()}
        self.panel.metrics = list(record.metrics)
        self._lines: deque[str] = deque(record.tail, maxlen=TAIL_LINES)
        self._count = sum(r.line_count for r in record.records.values())
        self._dirty = True
        self._done = threading.Event()
        self.handle: Any = None  # its display, updated at the end so a saved notebook keeps the final text
        self.text = widgets.HTML()
        self.text.add_class("nbaccel-run-output")
        self.shown = widgets.Output()
        self.box = widgets.VBox([self.text, self.shown])
        for rank, kind, body, labelled in record.displays:
            self.on_display(rank, kind, body, labelled)
        self._draw()
        if record.ok is not None:
            self._end_now(record.ok, record.ended)
        else:
            threading.Thread(target=self._tick, name="nbaccel-run-view", daemon=True).start()

    # ------------------------------------------------------------------ the record's events
    def on_state(self, rank: int, state: RankState) -> None:
        self.panel.on_state(rank, state)

    def on_output(self, rank: int, stream: Stream, line: str) -> None:
        self.panel.on_output(rank, stream, line)
        self._lines.append(f"[rank{rank}]: {line}")
        self._count += 1
        self._dirty = True

    def on_progress(self, rank: int, stream: Stream, text: str) -> None:
        self.panel.on_progress(rank, stream, text)

    def on_log(self, rank: int, record: dict[str, Any]) -> None:
        self.panel.on_log(rank, record)

    def on_display(self, rank: int, kind: str, body: dict[str, Any], labelled: bool) -> None:
        if kind == "clear_output":
            self.shown.outputs = ()
        elif not body.get("update", False):
            output = {"output_type": "display_data", "data": _bundle(body, rank, labelled),
                      "metadata": body.get("metadata") or {}}
            self.shown.outputs = (*self.shown.outputs, output)[-KEPT_DISPLAYS:]

    def on_end(self, ok: bool) -> None:
        self._end_now(ok, None)

    # ------------------------------------------------------------------ drawing
    def _end_now(self, ok: bool, ended: float | None) -> None:
        self._done.set()
        self.panel.on_end(ok)
        if ended is not None:  # shown after the end: the run's own end time, not now
            self.panel.ended = ended
            self.panel.draw(final=True)
        self._draw()
        if self.handle is not None:
            self.handle.update(self)

    def _tick(self) -> None:
        while not self._done.wait(self.interval):
            if self._dirty:
                self._draw()

    def _draw(self) -> None:
        self._dirty = False
        lines = list(self._lines)
        hidden = max(0, self._count - len(lines))
        note = f"... {hidden} earlier lines: run.output has each rank's\n" if hidden else ""
        # column-reverse: the box opens scrolled to its end, where the latest lines are
        self.text.value = ("<div style='max-height:24em;overflow:auto;display:flex;flex-direction:column-reverse'>"
                           f"<pre style='margin:0;flex-shrink:0'>{html.escape(note + chr(10).join(lines))}</pre></div>")

    def plain_text(self) -> str:
        """The output so far as text (what a saved notebook keeps)."""
        return "\n".join(self._lines)

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        empty = "(the run printed nothing)" if self._done.is_set() else "(no output yet)"
        return widget_bundle(self.box, self.plain_text() or empty)


def can_show_live() -> bool:
    """Whether :func:`show_run` shows a live view here (a notebook with ipywidgets), not printed text."""
    return widgets_available() and (in_notebook() or in_colab())


def show_run(run: Any) -> None:
    """Show ``run`` (a :class:`~nbaccel.runs.handle.LaunchRun`) in the current cell, live (see the module docstring)."""
    record: RunRecord = run.record
    if not can_show_live():
        with record.lock:
            tail = list(record.tail)
        print(f"{run!r}\n{record.text()}")
        if tail:
            print("\n".join(tail))
        return
    from IPython.display import display

    view = record.attach(RunOutputView)
    view.handle = display(view, display_id=True)
