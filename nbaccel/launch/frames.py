"""Length-prefixed message frames on the pipe between a worker and its supervisor.

A ``display`` or ``clear_output`` frame also leaves :data:`DISPLAY_MARK` in the rank's stdout just
after it, so the supervisor publishes the display between the lines printed before and after it.
"""

from __future__ import annotations

import os
import pickle
import struct
from collections.abc import Iterator
from typing import Any

__all__ = ["DISPLAY_MARK", "FrameReader", "write_frame"]

_HEADER = struct.Struct("!Q")
DISPLAY_MARK = b"\x00nbaccel:display\x00"  # under PIPE_BUF, so one write() puts it in the pipe whole


_ONE_WRITE = 1 << 20


def write_frame(fd: int, kind: str, body: Any) -> None:
    """Write one ``(kind, body)`` message to ``fd`` (blocking until it is all written)."""
    payload = pickle.dumps((kind, body), protocol=pickle.HIGHEST_PROTOCOL)
    header = _HEADER.pack(len(payload))
    # A small frame goes out in one write (one wake-up of the reader); a large one is not copied to join them.
    parts = (header + payload,) if len(payload) <= _ONE_WRITE else (header, payload)
    for part in parts:
        view = memoryview(part)
        while view:
            written = os.write(fd, view)
            view = view[written:]


class FrameReader:
    """Collects bytes read from a pipe and yields the complete messages in them.

    A message's bytes go straight into a buffer of exactly its length, allocated when its header
    arrives: a 300 MB result costs 300 MB here (plus its unpickled value), not a growing buffer
    and the copies slicing it would make.
    """

    def __init__(self) -> None:
        self._head = bytearray()
        self._body: bytearray | None = None
        self._filled = 0

    def feed(self, data: bytes) -> Iterator[tuple[str, Any]]:
        """Add ``data`` and yield every message it completes."""
        view = memoryview(data)
        while view:
            if self._body is None:
                need = _HEADER.size - len(self._head)
                self._head += view[:need]
                view = view[need:]
                if len(self._head) < _HEADER.size:
                    return
                (length,) = _HEADER.unpack(self._head)
                self._head.clear()
                self._body, self._filled = bytearray(length), 0
            take = min(len(view), len(self._body) - self._filled)
            self._body[self._filled:self._filled + take] = view[:take]
            self._filled += take
            view = view[take:]
            if self._filled == len(self._body):
                body, self._body = self._body, None
                yield pickle.loads(body)
