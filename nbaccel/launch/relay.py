"""Where one run's output goes: the cell (labelled per rank), the observer, and the chosen ranks' displays.

Every backend and lifetime builds its :class:`~nbaccel.launch.output.OutputRelay` here, so a
pool's run shows what a launch's shows.
"""

from __future__ import annotations

from nbaccel.launch.output import OutputRelay
from nbaccel.launch.request import LaunchRequest
from nbaccel.launch.rich_output import CellPublisher

__all__ = ["request_relay"]


def request_relay(request: LaunchRequest) -> OutputRelay:
    """Where a launch's output goes: the cell (labelled per rank), the observer, displays of the chosen ranks."""
    observer = request.observer
    return OutputRelay(show=request.output_ranks, on_line=observer.on_output if observer is not None else None,
                       on_display=CellPublisher(), display_ranks=request.output_ranks or (0,),
                       on_progress=getattr(observer, "on_progress", None),  # optional in the protocol
                       show_redraws=not getattr(observer, "shows_progress", False))
