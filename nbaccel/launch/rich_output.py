"""Publishing what workers displayed, in the caller: the cell's own outputs in a notebook, text elsewhere.

The relay calls the launch's :class:`CellPublisher` with a worker's mime bundle once the rank's
earlier lines are out. In an IPython shell it is published with
``IPython.display.display(..., raw=True)``, so a saved notebook holds it like any cell's output
(``update_display`` and ``clear_output`` as :class:`CellPublisher` says); anywhere else its
text/plain part is printed with the rank's label. With several ranks shown, each display opens
with the rank's label.
"""

from __future__ import annotations

import base64
import html
import sys
import uuid
from typing import Any

from nbaccel.launch.output import DisplayKind

__all__ = ["CellPublisher", "label_bundle"]

_IMAGES = ("image/png", "image/jpeg")


def _in_ipython() -> bool:
    shell_module = sys.modules.get("IPython.core.interactiveshell")
    return shell_module is not None and shell_module.InteractiveShell.initialized()


def label_bundle(data: dict[str, Any], rank: int) -> dict[str, Any]:
    """``data`` with its rank shown: a labelled HTML rendering and a labelled text/plain part.

    Example:
        >>> label_bundle({"text/plain": "42"}, 1)["text/plain"]
        '[rank1]: 42'
        >>> label_bundle({"image/png": b"PNG"}, 0)["image/png"]
        'UE5H'
    """
    label = f"[rank{rank}]"
    labelled = dict(data)
    for mime in _IMAGES:  # a worker's matplotlib formatter gives raw bytes; a bundle carries base64 text
        if isinstance(labelled.get(mime), (bytes, bytearray)):
            labelled[mime] = base64.b64encode(labelled[mime]).decode("ascii")
    body = data.get("text/html")
    if body is None:
        image = next((mime for mime in _IMAGES if mime in labelled), None)
        if image is not None:
            body = f'<img src="data:{image};base64,{labelled[image]}"/>'
        elif "image/svg+xml" in data:
            body = data["image/svg+xml"]
        else:
            body = f"<pre>{html.escape(str(data.get('text/plain', '')))}</pre>"
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


class CellPublisher:
    """Publishes one launch's worker displays in the caller
    (an :class:`~nbaccel.launch.output.OutputRelay` ``on_display``).

    ``clear_output`` from a worker clears what *that rank* displayed in this launch, not the whole
    cell: the other ranks' output, the printed lines and the status panel stay (a notebook's own
    ``clear_output`` would erase them all). With ``wait=True`` the rank's displays are cleared
    when its next display arrives, so a live plot redrawn in a loop does not flicker.

    Example::

        relay = OutputRelay(on_display=CellPublisher(), display_ranks=(0,))
        # outside IPython, a rank-0 display of 0.93 prints "[rank0]: 0.93"
    """

    def __init__(self) -> None:
        self._shown: dict[int, list[str]] = {}  # display ids this launch published, per rank
        self._clear_pending: set[int] = set()

    def __call__(self, rank: int, kind: DisplayKind, body: dict[str, Any], labelled: bool) -> None:
        """Show what ``rank`` displayed.

        Args:
            rank: the worker's rank.
            kind: ``"display"`` (a new or updated display) or ``"clear_output"``.
            body: the frame's body: ``data``, ``metadata``, ``transient`` and ``update`` for a
                display, ``wait`` for ``clear_output``.
            labelled: several ranks' displays are shown, so this one carries its rank.
        """
        if not _in_ipython():
            _print_text(rank, kind, body)
        elif kind == "clear_output":
            self._clear_pending.add(rank)
            if not body.get("wait", False):
                self._clear(rank)
        else:
            self._display(rank, body, labelled)

    def _clear(self, rank: int) -> None:
        from IPython.display import display

        self._clear_pending.discard(rank)
        for display_id in self._shown.pop(rank, []):
            display({}, raw=True, display_id=display_id, update=True)

    def _display(self, rank: int, body: dict[str, Any], labelled: bool) -> None:
        from IPython.display import display

        update = bool(body.get("update", False))
        if rank in self._clear_pending and not update:
            self._clear(rank)
        data = label_bundle(body.get("data", {}), rank) if labelled else body.get("data", {})
        transient = dict(body.get("transient") or {})
        if not update:  # every display gets an id, so a later clear_output of this rank can blank it
            transient.setdefault("display_id", f"nbaccel-{uuid.uuid4().hex}")
            self._shown.setdefault(rank, []).append(transient["display_id"])
        display(data, raw=True, metadata=body.get("metadata") or {}, transient=transient, update=update)
