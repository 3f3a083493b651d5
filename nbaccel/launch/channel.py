"""A worker's channel to the launching process: messages sent while the function runs.

:func:`~nbaccel.launch.worker.run_body` opens it on the rank's control pipe before the function
starts and closes it after; code inside the function (the notebook tracker) finds it with
:func:`current_channel`. Outside an nbaccel launch, or under a launcher without a control pipe
(torch's elastic agent on several machines), there is none. Like the identity, a channel is per
process, or per thread for XLA replica threads that share one process.

Messages are :mod:`~nbaccel.launch.frames` on the same pipe as the ``result`` frame; a lock keeps
frames from two threads of one worker from interleaving.
"""

from __future__ import annotations

import threading
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

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._lock = threading.Lock()

    def send(self, kind: str, body: Any) -> None:
        """Send one ``(kind, body)`` frame (blocks only while the pipe is full; the supervisor reads it)."""
        with self._lock:
            write_frame(self.fd, kind, body)


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
    """Forget the calling worker's channel (the pipe itself belongs to the worker body)."""
    global _process
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
