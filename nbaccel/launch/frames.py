"""Length-prefixed message frames on the pipe between a worker and its supervisor.

A ``display`` or ``clear_output`` frame also leaves :data:`DISPLAY_MARK` in the rank's stdout,
written just after the frame, so the supervisor publishes the display exactly between the lines
the rank printed before it and those it printed after.
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


def write_frame(fd: int, kind: str, body: Any) -> None:
    """Write one ``(kind, body)`` message to ``fd`` (blocking until it is all written)."""
    payload = pickle.dumps((kind, body), protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(payload)) + payload)
    while view:
        written = os.write(fd, view)
        view = view[written:]


class FrameReader:
    """Collects bytes read from a pipe and yields the complete messages in them."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> Iterator[tuple[str, Any]]:
        """Add ``data`` and yield every message it completes."""
        self._buffer += data
        while len(self._buffer) >= _HEADER.size:
            (length,) = _HEADER.unpack_from(self._buffer)
            end = _HEADER.size + length
            if len(self._buffer) < end:
                return
            message = pickle.loads(bytes(self._buffer[_HEADER.size:end]))
            del self._buffer[:end]
            yield message
