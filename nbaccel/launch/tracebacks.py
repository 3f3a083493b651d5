"""Worker tracebacks as a user reads them: without the launcher's own frames, cells named as IPython names them.

A worker's traceback starts in nbaccel's worker body, goes through the cell program or the
script runner (``runpy``) or torch's elastic agent, and only then reaches the user's code. Those
frames say nothing to the user; this is the one place that drops them, for the notebook (the
magics) and the terminal (``nbaccel launch``) alike. Frames of nbaccel's training code (the
``Accelerator``) are kept: the error may well be there.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

__all__ = ["is_launch_frame", "trim_traceback"]

_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LAUNCH_PARTS = tuple(os.path.join(_PACKAGE_DIR, part) + os.sep for part in ("launch", "cli", "magics"))
_FOREIGN = re.compile(r"(^<frozen runpy>|(^|[/\\])runpy\.py|torch[/\\]distributed[/\\]elastic[/\\].+\.py)$")


def is_launch_frame(filename: str) -> bool:
    """Whether ``filename`` belongs to the launching machinery (nbaccel's launch, CLI or magics; runpy; torch elastic).

    Example:
        >>> is_launch_frame("<frozen runpy>"), is_launch_frame("/home/me/train.py")
        (True, False)
    """
    if _FOREIGN.search(filename):
        return True
    path = os.path.abspath(filename) if os.sep in filename else filename
    return path.startswith(_LAUNCH_PARTS)


def trim_traceback(text: str, cell_numbers: Mapping[str, int] | None = None) -> str:
    """``text`` without the launcher's frames; cells named ``Cell In[N]`` when ``cell_numbers`` knows them.

    Args:
        text: a traceback as ``traceback.format_exception`` writes it.
        cell_numbers: ``{filename: execution count}`` of the notebook's cells.

    Example:
        >>> print(trim_traceback('Traceback (most recent call last):\\n  File "<frozen runpy>", line 1, in run\\n'
        ...                      '  File "c1", line 2, in <module>\\n    1/0\\nZeroDivisionError: division by zero',
        ...                      {"c1": 3}))
        Traceback (most recent call last):
          Cell In[3], line 2
            1/0
        ZeroDivisionError: division by zero
    """
    cells = cell_numbers or {}
    out: list[str] = []
    skipping = False
    for line in text.rstrip("\n").split("\n"):
        match = _FRAME.match(line)
        if match:
            filename = match["file"]
            skipping = is_launch_frame(filename)
            if skipping:
                continue
            if filename in cells:
                where = f"  Cell In[{cells[filename]}], line {match['line']}"
                out.append(where if match["func"] == "<module>" else f"{where}, in {match['func']}")
            else:
                out.append(line)
            continue
        if skipping and line.startswith("    "):
            continue  # the source (and ^^^ marker) lines of a skipped frame
        skipping = False
        out.append(line)
    return "\n".join(out)
