"""The live chart of a launch: what workers pass to ``accelerator.log``, one line per metric, x = step.

Drawn with matplotlib (the ``live`` extra) through its object API and the Agg canvas, so it
renders to PNG bytes from any thread, with no pyplot state and no GUI backend: the PNG goes into
an ``ipywidgets.Image`` while the launch runs, and is the image kept in the saved notebook when
it ends. matplotlib was chosen over plotly and bqplot because a PNG needs no frontend extension,
renders the same in JupyterLab, classic Notebook, Colab, VS Code and nbconvert/GitHub, and stays
in the saved notebook; bqplot and plotly need their JavaScript in every frontend.

Redraws are rate-limited: at most one per :attr:`LiveChart.min_interval` (0.5 s by default), and
no sooner than twenty times the last redraw's own duration after it (:attr:`LiveChart.cpu_share`),
so drawing takes at most about 5% of one CPU from the workers on a small machine (a redraw
takes about 0.1 s here); records arriving in between are drawn
together by the next redraw. Without matplotlib the chart is the text table
of :func:`~nbaccel.tracking.history.metrics_table`.
"""

from __future__ import annotations

import html
import importlib.util
import io
import time
from typing import Any

from nbaccel.tracking.history import metric_names, metrics_table, series

__all__ = ["ChartFigure", "LiveChart", "render_png"]


class ChartFigure:
    """A matplotlib figure kept between redraws: new records only update its lines' data.

    Building a figure costs about three times as much as redrawing one, so the figure, its
    axes and one line per metric are made once and rebuilt only when a new metric appears.
    Metrics that need their own scale (a loss near 1, a learning rate near 1e-4) each get a
    small panel side by side; up to 4 panels, the rest share the last one.
    """

    def __init__(self, *, width: float = 6.4, height: float = 2.6) -> None:
        self.width, self.height = width, height
        self._names: list[str] = []
        self.rebuilt = False  # whether the last render built the figure (slower: not a redraw's cost)
        self._figure: Any = None
        self._lines: dict[str, Any] = {}
        self._axes: list[Any] = []

    def _build(self, names: list[str], title: str) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        panels = min(len(names), 4) or 1
        figure = Figure(figsize=(max(self.width, 2.6 * panels), self.height), dpi=80)
        FigureCanvasAgg(figure)
        axes = list(figure.subplots(1, panels, squeeze=False)[0])
        figure.subplots_adjust(left=0.1 / panels + 0.02, right=0.98, bottom=0.2, top=0.82, wspace=0.35)
        self._lines = {}
        for index, name in enumerate(names):
            ax = axes[min(index, panels - 1)]
            (self._lines[name],) = ax.plot([], [], label=name)
            ax.set_xlabel("step")
            ax.grid(True, alpha=0.3)
            ax.set_title(name if index < panels - 1 or len(names) == panels else "", fontsize=9)
        if len(names) > panels:
            axes[-1].legend(fontsize=7)
        if title:
            figure.suptitle(title, fontsize=10)
        self._figure, self._axes, self._names = figure, axes, names

    def render(self, records: list[dict[str, Any]], title: str = "") -> bytes:
        """``records`` drawn as PNG bytes (one line per numeric metric, x = step)."""
        names = metric_names(records)
        self.rebuilt = self._figure is None or names != self._names
        if self.rebuilt:
            self._build(names, title)
        for name, line in self._lines.items():
            line.set_data(*series(records, name))
            line.set_marker("." if len(line.get_xdata()) < 40 else "")
        for ax in self._axes:
            ax.relim()
            ax.autoscale_view()
        buffer = io.BytesIO()
        self._figure.savefig(buffer, format="png")
        return buffer.getvalue()


def render_png(records: list[dict[str, Any]], title: str = "", *, width: float = 6.4, height: float = 2.6) -> bytes:
    """``records`` drawn as a line chart (one line per numeric metric, x = step), as PNG bytes.

    Example:
        >>> png = render_png([{"step": 0, "loss": 1.0}, {"step": 1, "loss": 0.5}])
        >>> png[:8] == b"\\x89PNG\\r\\n\\x1a\\n"
        True
    """
    return ChartFigure(width=width, height=height).render(records, title)


class LiveChart:
    """The chart part of the status panel: an ``Image`` (or an HTML table without matplotlib).

    Args:
        widgets: the ipywidgets module.
        min_interval: least seconds between two redraws.
        cpu_share: the most of one CPU that redrawing may take (the wait after a redraw is at
            least its duration divided by this).

    Attributes:
        draws: how many times it was redrawn (the rate limit shows in it).
        drawn_count: how many records the last redraw showed.
        png: the last PNG drawn (``b""`` before the first).

    Example:
        >>> import ipywidgets
        >>> chart = LiveChart(ipywidgets, min_interval=0.0)
        >>> chart.update([{"step": 0, "loss": 1.0}]), chart.draws
        (True, 1)
    """

    def __init__(self, widgets: Any, min_interval: float = 0.5, cpu_share: float = 0.05) -> None:
        self.min_interval = min_interval
        self.cpu_share = cpu_share
        self.draws = 0
        self.png = b""
        self.has_matplotlib = importlib.util.find_spec("matplotlib") is not None
        self.drawn_count = 0
        self._next = 0.0
        self._figure = ChartFigure()
        if self.has_matplotlib:
            self.view = widgets.Image(format="png", layout=widgets.Layout(display="none", max_width="100%"))
        else:
            self.view = widgets.HTML(layout=widgets.Layout(display="none"))
        self.view.add_class("nbaccel-chart")

    def update(self, records: list[dict[str, Any]], title: str = "", *, force: bool = False) -> bool:
        """Redraw when there are new records and ``min_interval`` has passed (or ``force``); ``True`` if drawn."""
        if not records or (len(records) == self.drawn_count and not force):
            return False
        now = time.monotonic()
        if not force and now < self._next:
            return False
        self.drawn_count = len(records)
        if self.has_matplotlib:
            self.png = self._figure.render(records, title)
            self.view.value = self.png
        else:
            self.view.value = f"<pre style='margin:0'>{html.escape(metrics_table(records))}</pre>"
        self.view.layout.display = None
        self.draws += 1
        took = 0.0 if self._figure.rebuilt else time.monotonic() - now  # building (and importing) is not redrawing
        self._next = now + max(self.min_interval, took / self.cpu_share)
        return True
