"""Worker tracebacks as users read them: the launcher's own frames dropped, notebook cells named.

One trimmer for the notebook (``%%accel_launch``) and the terminal (``nbaccel launch``). The
frames dropped are the machinery between the user's code and the worker process: nbaccel's
launch, magics and CLI modules, ``runpy``, and torch's elastic agent. Frames of the user's
code, of libraries, and of nbaccel's training API (an error raised inside ``Accelerator``)
stay, so the traceback still shows where the error came from.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = ["clean_traceback"]

_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')
_MACHINERY = re.compile(r"(^<frozen runpy>|[/\\](nbaccel[/\\](launch|cli|magics)[/\\](?:[^/\\]+[/\\])*[^/\\]+\.py|"
                        r"runpy\.py|"
                        r"torch[/\\]distributed[/\\]elastic[/\\].+\.py))$")


def clean_traceback(text: str, cell_numbers: Mapping[str, int] | None = None) -> str:
    """``text`` without the launcher's frames, with notebook cells named as IPython names them.

    Args:
        text: a traceback as ``traceback.format_exception`` writes it.
        cell_numbers: ``{filename: execution count}`` of the notebook's cells (none outside a notebook).

    Returns:
        The traceback, each kept frame with its source lines.

    Example:
        >>> print(clean_traceback('Traceback (most recent call last):\\n'
        ...                       '  File "/x/nbaccel/launch/worker/process.py", line 9, in run\\n    fn()\\n'
        ...                       '  File "c1", line 2, in <module>\\n    1/0\\n'
        ...                       'ZeroDivisionError: division by zero', {"c1": 3}))
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
            skipping = bool(_MACHINERY.search(filename))
            if not skipping and filename in cells:
                where = f"  Cell In[{cells[filename]}], line {match['line']}"
                out.append(where if match["func"] == "<module>" else f"{where}, in {match['func']}")
            elif not skipping:
                out.append(line)
            continue
        if skipping and line.startswith("    "):
            continue  # the source (and ^^^ marker) lines of a dropped frame
        skipping = False
        out.append(line)
    return "\n".join(out)
