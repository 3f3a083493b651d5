"""The status panel's HTML: the rank table (state, elapsed, progress, last line) and a rank's output.

Pure functions of a launch's per-rank records, so the panel's drawing code only decides *when*
to redraw and *which* sections; what each piece looks like lives here, and renders the same
from a test or a terminal-less kernel.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from typing import Protocol

from nbaccel.widgets.progress import progress_fraction

__all__ = ["STATE_COLORS", "output_html", "progress_cell_html", "rank_table_html"]

STATE_COLORS: dict[str, str] = {"starting": "#6b7280", "running": "#2563eb", "finished": "#16a34a",
                                "failed": "#dc2626", "stopped": "#d97706"}
"""The colour each rank state (and the launch's overall state) is shown in."""
_PROGRESS_HEAD = "<th style='padding:0 8px;white-space:nowrap;text-align:left'>progress</th>"


class RankRecord(Protocol):
    """What is read of a rank's record (:class:`nbaccel.widgets.status_panel.RankRecord` has it); read-only here."""

    @property
    def rank(self) -> int: ...
    @property
    def state(self) -> str: ...
    @property
    def progress(self) -> str: ...
    @property
    def last_line(self) -> str: ...
    @property
    def lines(self) -> Iterable[str]: ...
    @property
    def line_count(self) -> int: ...

    def elapsed(self, now: float, launched: float | None) -> float: ...


def rank_table_html(records: Sequence[RankRecord], launched: float | None, now: float) -> str:
    """One row per rank: state, elapsed time, progress (a column only once some rank has a bar), last line.

    The table fits the cell's width whatever the line length: labels never wrap, and the last line
    takes the room left and is cut with an ellipsis, its full text in the ``title`` (shown on hover).

    Example:
        >>> from nbaccel.widgets.status_panel import RankRecord
        >>> "title='" + "x" * 300 + "'" in rank_table_html([RankRecord(0, last_line="x" * 300)], None, 0.0)
        True
    """
    bars = any(r.progress for r in records)
    rows = []
    for r in records:
        last = html.escape(r.last_line, quote=True)
        rows.append(
            f"<tr><td class='nbaccel-rank-label' style='{_CELL}'>rank {r.rank}</td>"
            f"<td style='{_CELL};color:{STATE_COLORS[r.state]};font-weight:bold'>{r.state}</td>"
            f"<td style='{_CELL};text-align:right'>{r.elapsed(now, launched):.1f} s</td>"
            f"{progress_cell_html(r.progress) if bars else ''}"
            f"<td class='nbaccel-last-line' title='{last}' style='{_CELL};{_FILL_AND_CUT}'>{last}</td></tr>")
    head = (f"<tr><th style='{_CELL};text-align:left'>rank</th><th style='{_CELL};text-align:left'>state</th>"
            f"<th style='{_CELL}'>elapsed</th>{_PROGRESS_HEAD if bars else ''}"
            f"<th style='{_CELL};text-align:left'>last line</th></tr>")
    return f"<table class='nbaccel-ranks' style='width:100%'>{head}{''.join(rows)}</table>"


# max-width:0 with width:100% makes the cell take what the other columns leave, never more: a long line
# then overflows the cell (cut with an ellipsis) instead of widening the table past the output area
_CELL = "padding:0 8px;white-space:nowrap"
_FILL_AND_CUT = "font-family:monospace;width:100%;max-width:0;overflow:hidden;text-overflow:ellipsis"


def progress_cell_html(text: str) -> str:
    """One rank's progress cell: a bar where the text shows a fraction, and the bar's own text.

    Example:
        >>> "value='0.500'" in progress_cell_html(" 50%|#####     | 5/10")
        True
    """
    fraction = progress_fraction(text)
    bar = (f"<progress class='nbaccel-progress' value='{fraction:.3f}' max='1' style='width:8em'></progress> "
           if fraction is not None else "")
    shown = text.strip() if len(text.strip()) <= 60 else text.strip()[:57] + "..."
    return f"<td style='padding:0 8px;white-space:nowrap;font-family:monospace'>{bar}{html.escape(shown)}</td>"


def output_html(record: RankRecord, limit: int | None) -> str:
    """A rank's output lines (the last ``limit``, all when ``None``), with a note of how many are hidden."""
    lines = list(record.lines)
    if limit is not None:
        lines = lines[-limit:]
    hidden = record.line_count - len(lines)
    note = f"... {hidden} earlier lines not shown\n" if hidden else ""
    return f"<pre style='max-height:24em;overflow:auto;margin:0'>{html.escape(note + chr(10).join(lines))}</pre>"
