"""The live chart of a launch: what workers pass to ``accelerator.log``, one line per metric, x = step.

Drawn with matplotlib (the ``live`` extra) through its object API and the Agg canvas, so it
renders to PNG bytes from any thread, with no pyplot state and no GUI backend: the PNG goes into
an ``ipywidgets.Image`` while the launch runs, and is the image kept in the saved notebook when
it ends. matplotlib was chosen over plotly and bqplot because a PNG needs no frontend extension,
renders the same in JupyterLab, classic Notebook, Colab, VS Code and nbconvert/GitHub, and stays
in the saved notebook; bqplot and plotly need their JavaScript in every frontend.

Redraws are rate-limited (:attr:`LiveChart.min_interval`, 0.5 s by default): records arriving in
between are drawn together by the next redraw. Without matplotlib the chart is the text table
of :func:`~nbaccel.tracking.history.metrics_table`.
"""

from __future__ import annotations

import html
import importlib.util
import io
import time
from typing import Any

from nbaccel.tracking.history import metric_names, metrics_table, series

__all__ = ["LiveChart", "render_png"]


def render_png(records: list[dict[str, Any]], title: str = "", *, width: float = 6.4, height: float = 2.6) -> bytes:
    """``records`` drawn as a line chart (one line per numeric metric, x = step), as PNG bytes.

    Metrics that need their own scale (for example a loss near 1 and a learning rate near 1e-4)
    each get a small panel side by side; up to 4 panels, the rest share the last one.

    Example:
        >>> png = render_png([{"step": 0, "loss": 1.0}, {"step": 1, "loss": 0.5}])
        >>> png[:8] == b"\\x89PNG\\r\\n\\x1a\\n"
        True
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = metric_names(records)
    panels = min(len(names), 4) or 1
    figure = Figure(figsize=(max(width, 2.6 * panels), height), dpi=80, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, panels, squeeze=False)[0]
    for index, name in enumerate(names):
        ax = axes[min(index, panels - 1)]
        steps, values = series(records, name)
        ax.plot(steps, values, marker="." if len(steps) < 40 else None, label=name)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        ax.set_title(name if index < panels - 1 or len(names) == panels else "", fontsize=9)
    if len(names) > panels:
        axes[-1].legend(fontsize=7)
    if title:
        figure.suptitle(title, fontsize=10)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


class LiveChart:
    """The chart part of the status panel: an ``Image`` (or an HTML table without matplotlib).

    Args:
        widgets: the ipywidgets module.
        min_interval: least seconds between two redraws.

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

    def __init__(self, widgets: Any, min_interval: float = 0.5) -> None:
        self.min_interval = min_interval
        self.draws = 0
        self.png = b""
        self.has_matplotlib = importlib.util.find_spec("matplotlib") is not None
        self.drawn_count = 0
        self._last = 0.0
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
        if not force and now - self._last < self.min_interval:
            return False
        self._last, self.drawn_count = now, len(records)
        if self.has_matplotlib:
            self.png = render_png(records, title)
            self.view.value = self.png
        else:
            self.view.value = f"<pre style='margin:0'>{html.escape(metrics_table(records))}</pre>"
        self.view.layout.display = None
        self.draws += 1
        return True
