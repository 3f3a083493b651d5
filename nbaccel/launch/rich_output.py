"""Publishing what workers displayed, in the caller: the cell's own outputs in a notebook, text elsewhere.

The supervisor receives a worker's display as a mime bundle (``{"text/html": ..., "image/png":
..., "text/plain": ...}``, as IPython formatted it in the worker) and the relay calls
:func:`publish_display` once the rank's earlier lines are out. In an IPython shell (a Jupyter
kernel above all) the bundle is published with ``IPython.display.display(..., raw=True)``, so a
saved notebook holds the HTML and images like any cell's; ``update_display`` and ``clear_output``
act on the cell as they would in the notebook (``clear_output`` clears the whole cell, the rank's
printed lines included). Anywhere else (``nbaccel launch``, a plain ``python``), the text/plain
part is printed with the rank's label.

With several ranks shown, each display says whose it is: an HTML rendering of the bundle opens
with the rank's label, and the text/plain part starts with it.
"""

from __future__ import annotations

import html
import sys
from typing import Any

from nbaccel.launch.output import DisplayKind

__all__ = ["label_bundle", "publish_display"]

_IMAGES = ("image/png", "image/jpeg")


def _in_ipython() -> bool:
    shell_module = sys.modules.get("IPython.core.interactiveshell")
    return shell_module is not None and shell_module.InteractiveShell.initialized()


def label_bundle(data: dict[str, Any], rank: int) -> dict[str, Any]:
    """``data`` with its rank shown: a labelled HTML rendering and a labelled text/plain part.

    Example:
        >>> label_bundle({"text/plain": "42"}, 1)["text/plain"]
        '[rank1]: 42'
    """
    label = f"[rank{rank}]"
    body = data.get("text/html")
    if body is None:
        image = next((mime for mime in _IMAGES if mime in data), None)
        if image is not None:
            body = f'<img src="data:{image};base64,{data[image]}"/>'
        elif "image/svg+xml" in data:
            body = data["image/svg+xml"]
        else:
            body = f"<pre>{html.escape(str(data.get('text/plain', '')))}</pre>"
    labelled = dict(data)
    labelled["text/html"] = f'<div style="font-family:monospace;opacity:0.7">{label}</div>{body}'
    labelled["text/plain"] = f"{label}: {data.get('text/plain', '')}"
    return labelled


def _print_text(rank: int, kind: DisplayKind, body: dict[str, Any]) -> None:
    if kind == "clear_output":
        return  # a terminal keeps what it printed
    data = body.get("data", {})
    text = data.get("text/plain") or f"<display: {', '.join(sorted(data))}>"
    sys.stdout.write("".join(f"[rank{rank}]: {line}\n" for line in str(text).splitlines() or [""]))
    sys.stdout.flush()


def publish_display(rank: int, kind: DisplayKind, body: dict[str, Any], labelled: bool) -> None:
    """Show in the caller what ``rank`` displayed (an :class:`~nbaccel.launch.output.OutputRelay` ``on_display``).

    Args:
        rank: the worker's rank.
        kind: ``"display"`` (a new or updated display) or ``"clear_output"``.
        body: the frame's body: ``data``, ``metadata``, ``transient`` and ``update`` for a display,
            ``wait`` for ``clear_output``.
        labelled: several ranks' displays are shown, so this one carries its rank.

    Example::

        # outside IPython this prints "[rank0]: 0.93"
        publish_display(0, "display", {"data": {"text/plain": "0.93"}}, labelled=False)
    """
    if not _in_ipython():
        _print_text(rank, kind, body)
        return
    from IPython.display import clear_output, display

    if kind == "clear_output":
        clear_output(wait=bool(body.get("wait", False)))
        return
    data = body.get("data", {})
    update = bool(body.get("update", False))
    if labelled:  # an update replaces a labelled display: it keeps the label
        data = label_bundle(data, rank)
    display(data, raw=True, metadata=body.get("metadata") or {}, transient=body.get("transient") or None,
            update=update)
