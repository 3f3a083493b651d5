"""A worker's channel to the launching process: messages sent while the function runs.

:func:`~nbaccel.launch.worker.process.run_body` opens it on the rank's control pipe before the function
starts and closes it after; code inside the function (the notebook tracker) finds it with
:func:`current_channel`. Outside an nbaccel launch, or under torch's elastic agent, there is none.
A channel is per process, or per thread for XLA replica threads that share one process.

Messages are :mod:`~nbaccel.launch.frames` on the same pipe as the ``result`` frame; a lock keeps
frames from two threads from interleaving. Frequent small messages are posted, not sent: they go
out together at most every ``flush_interval`` (0.2 s), and when the channel closes (a wake-up per
step slowed a 2-process DDP loop by a quarter, ``benchmarks/tracking.py``).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from nbaccel.launch.frames import write_frame

__all__ = ["Channel", "close_channel", "current_channel", "open_channel"]


class Channel:
    """The write end of one rank's control pipe.

    Example:
        >>> import os
        >>> from nbaccel.launch.frames import FrameReader
        >>> read_fd, write_fd = os.pipe()
        >>> Channel(write_fd).send("log", {"step": 1, "loss": 0.5})
        >>> list(FrameReader().feed(os.read(read_fd, 4096)))
        [('log', {'step': 1, 'loss': 0.5})]
    """

    def __init__(self, fd: int, flush_interval: float = 0.2) -> None:
        self.fd = fd
        self.flush_interval = flush_interval
        self._lock = threading.Lock()
        self._pending: dict[str, list[Any]] = {}
        self._flushed = time.monotonic()

    def send(self, kind: str, body: Any) -> None:
        """Send one ``(kind, body)`` frame now, after what was posted (blocks only while the pipe is full)."""
        with self._lock:
            self._flush_locked()
            write_frame(self.fd, kind, body)

    def post(self, kind: str, item: Any) -> None:
        """Queue ``item``; the queue goes out as one ``(kind, {"items": [...]})`` frame every ``flush_interval``.

        Example:
            >>> import os
            >>> from nbaccel.launch.frames import FrameReader
            >>> read_fd, write_fd = os.pipe()
            >>> channel = Channel(write_fd, flush_interval=60)
            >>> channel.post("log", 1); channel.post("log", 2); channel.flush()
            >>> list(FrameReader().feed(os.read(read_fd, 4096)))
            [('log', {'items': [1, 2]})]
        """
        with self._lock:
            self._pending.setdefault(kind, []).append(item)
            if time.monotonic() - self._flushed >= self.flush_interval:
                self._flush_locked()

    def flush(self) -> None:
        """Send what was posted and not sent yet."""
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        self._flushed = time.monotonic()
        pending, self._pending = self._pending, {}
        for kind, items in pending.items():
            write_frame(self.fd, kind, {"items": items})


_process: Channel | None = None
_thread = threading.local()


def open_channel(fd: int, *, thread: bool = False) -> Channel:
    """Make ``fd`` the calling worker's channel (``thread=True``: the calling thread's only)."""
    global _process
    channel = Channel(fd)
    if thread:
        _thread.channel = channel
    else:
        _process = channel
    return channel


def close_channel(*, thread: bool = False) -> None:
    """Send what was posted, then forget the calling worker's channel (the pipe belongs to the worker body)."""
    global _process
    channel = getattr(_thread, "channel", None) if thread else _process
    if channel is not None:
        try:
            channel.flush()
        except OSError:  # the launching process is gone; the worker is about to be stopped anyway
            pass
    if thread:
        _thread.channel = None
    else:
        _process = None


def current_channel() -> Channel | None:
    """The calling thread's channel, else its process's; ``None`` outside an nbaccel launch.

    Example:
        >>> current_channel() is None   # a plain process
        True
    """
    return getattr(_thread, "channel", None) or _process
