"""How a failed or interrupted launch reads in the notebook: the root-cause rank's traceback.

IPython shows an exception through its ``_render_traceback_()`` when it has one (ipyparallel
does the same for engine errors). We attach one that shows the worker's traceback, starting at
the cell, with cells named as IPython names them (``Cell In[5], line 4``), then nbaccel's report
of the other ranks; the exception keeps its own type and its ``launch_failures``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["attach_renderer", "clean_traceback", "render_interrupt"]

_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _internal(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_PACKAGE_DIR + os.sep)


def clean_traceback(text: str, cell_numbers: Mapping[str, int]) -> str:
    """``text`` without nbaccel's own frames before the user's code, with cells named ``Cell In[N]``.

    Args:
        text: a traceback as ``traceback.format_exception`` writes it.
        cell_numbers: ``{filename: execution count}`` of the notebook's cells.

    Example:
        >>> print(clean_traceback('Traceback (most recent call last):\\n  File "c1", line 2, in <module>\\n'
        ...                       '    1/0\\nZeroDivisionError: division by zero', {"c1": 3}))
        Traceback (most recent call last):
          Cell In[3], line 2
            1/0
        ZeroDivisionError: division by zero
    """
    out: list[str] = []
    skipping = False
    for line in text.rstrip("\n").split("\n"):
        if line.startswith("Traceback (most recent call last):"):
            skipping = True
            out.append(line)
            continue
        match = _FRAME.match(line)
        if match:
            filename = match["file"]
            skipping = skipping and _internal(filename)
            if skipping:
                continue
            if filename in cell_numbers:
                where = f"  Cell In[{cell_numbers[filename]}], line {match['line']}"
                func = match["func"]
                out.append(where if func == "<module>" else f"{where}, in {func}")
            else:
                out.append(line)
            continue
        if skipping and line.startswith("    "):
            continue  # the source (and ^^^ marker) lines of a skipped frame
        skipping = False
        out.append(line)
    return "\n".join(out)


def _render_failure(exc: BaseException, failures: tuple, cell_numbers: Mapping[str, int]) -> list[str]:
    root = failures[0]
    lines = [f"{type(exc).__name__} on rank {root.rank} (the root cause of the failed launch); "
             "its traceback in the worker:"]
    if root.traceback:
        lines.append(clean_traceback(root.traceback, cell_numbers))
    else:
        lines.append(f"{type(exc).__name__}: {exc}")
    notes = [n for n in getattr(exc, "__notes__", ()) if n.startswith("[nbaccel]")]
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
        exc._render_traceback_ = lambda: lines  # type: ignore[attr-defined]
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
    exc._render_traceback_ = lambda: [f"KeyboardInterrupt: {exc}"]  # type: ignore[attr-defined]
    return exc
