"""The matplotlib backend of a worker: ``plt.show()`` displays each open figure as a PNG, like the inline backend.

Set by :func:`nbaccel.launch.worker.display.route_figures` when the notebook's backend is the
inline one or none was chosen. It draws with Agg; ``show()`` displays every open figure (forwarded
to the launching cell) and closes it; figures still open when the function returns are shown then.
"""

from __future__ import annotations

from typing import Any

from matplotlib._pylab_helpers import Gcf
from matplotlib.backend_bases import FigureManagerBase
from matplotlib.backends.backend_agg import FigureCanvasAgg

__all__ = ["FigureCanvas", "FigureManager", "show", "show_open_figures"]

FigureCanvas = FigureCanvasAgg
FigureManager = FigureManagerBase


def show_open_figures() -> int:
    """Display every open figure and close it; returns how many were shown."""
    from IPython.display import display

    managers = Gcf.get_all_fig_managers()
    for manager in managers:
        display(manager.canvas.figure)
    for manager in managers:
        Gcf.destroy(manager)
    return len(managers)


def show(*args: Any, **kwargs: Any) -> None:
    """``plt.show()``: display the open figures in the launching cell."""
    show_open_figures()
