"""How a failed or interrupted launch reads in the notebook: the root-cause rank's traceback.

IPython shows an exception through its ``_render_traceback_()`` when it has one (ipyparallel
does the same for engine errors). We attach one that shows the worker's traceback, starting at
the cell, with cells named as IPython names them (``Cell In[5], line 4``), then nbaccel's report
of the other ranks; the exception keeps its own type and its ``launch_failures``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nbaccel.tracebacks import clean_traceback

__all__ = ["attach_renderer", "render_interrupt"]


def _render_failure(exc: BaseException, failures: tuple, cell_numbers: Mapping[str, int]) -> list[str]:
    root = failures[0]
    alike = sorted(f.rank for f in failures if root.exc_type and
                   (f.exc_type, f.message, f.traceback) == (root.exc_type, root.message, root.traceback))
    where = (f"rank {root.rank} (the root cause of the failed launch)" if len(alike) < 2
             else f"ranks {', '.join(map(str, alike))} (each raised it; rank {root.rank}'s is shown)")
    lines = [f"{type(exc).__name__} on {where}; its traceback in the worker:"]
    if root.traceback:
        lines.append(clean_traceback(root.traceback, cell_numbers))
    else:
        lines.append(f"{type(exc).__name__}: {exc}")
    notes = [n for n in getattr(exc, "__notes__", ()) if n.startswith("[nbaccel]")]
    if not notes and root.traceback:  # a plain WorkerFailedError: its report is its message, before the traceback
        notes = [f"[nbaccel] {str(exc).split(chr(10) * 2)[0]}"]
    lines.extend(notes)
    return lines


def attach_renderer(exc: BaseException, shell: Any) -> BaseException:
    """Give ``exc`` a ``_render_traceback_`` for IPython and return it (unchanged otherwise)."""
    cell_numbers = dict(getattr(getattr(shell, "compile", None), "_filename_map", {}) or {})
    failures = getattr(exc, "launch_failures", None) or getattr(exc, "failures", None)
    if failures:
        lines = _render_failure(exc, tuple(failures), cell_numbers)
    else:
        lines = [f"{type(exc).__name__}: {exc}"]
    try:
        exc._render_traceback_ = lambda: lines  # type: ignore[attr-defined]  # IPython's hook on the exception object
    except AttributeError:  # an exception type without a __dict__: IPython's own traceback then
        pass
    return exc


def render_interrupt(observer: Any) -> KeyboardInterrupt:
    """The ``KeyboardInterrupt`` a cell shows after its launch was interrupted."""
    stopped = ""
    records = getattr(observer, "records", None)
    if records:
        stopped = f" ({len(records)} ranks)"
    exc = KeyboardInterrupt(f"the launch was interrupted; every worker{stopped} was stopped")
    exc._render_traceback_ = lambda: [f"KeyboardInterrupt: {exc}"]  # type: ignore[attr-defined]  # IPython's hook on the exception object
    return exc
