"""The rendezvous store of a single-machine launch: hosted by the launcher, on loopback only.

The launcher binds a socket to ``127.0.0.1`` itself (port 0 picks a free one, so back-to-back
launches never collide) and hands it to a ``TCPStore`` it owns; every worker joins as a client
through torch's agent-store protocol. The port is released when the launch ends.
"""

from __future__ import annotations

import errno
import os
import socket
from datetime import timedelta

from nbaccel.errors import LaunchError

__all__ = ["LoopbackStore", "is_port_in_use"]


class LoopbackStore:
    """A ``TCPStore`` listening on ``host`` only, owned by this process.

    Args:
        port: the port to listen on; ``0`` picks a free one.
        host: the address to listen on (loopback for single-machine launches).
        timeout: how long workers may take to reach the store.

    Raises:
        LaunchError: ``port`` is already in use.
    """

    def __init__(self, port: int = 0, host: str = "127.0.0.1", timeout: float = 300.0) -> None:
        # Imported here, before any worker is forked: an interrupt that lands in the middle of
        # importing torch leaves it half-initialised, and the next launch's import then crashes
        # the interpreter (seen as a kernel that dies after the stop button). Forked workers
        # also inherit the imported module instead of each importing it again.
        import torch.distributed  # noqa: F401
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:
                raise LaunchError(f"port {port} on {host} is already in use. Fix: pass another "
                                  "use_port, or leave it unset so nbaccel picks a free port.") from None
            raise
        sock.listen(512)
        self.host = host
        self.port: int = sock.getsockname()[1]
        self.listen_fd = sock.detach()  # the store owns and closes it
        self._timeout = timeout
        self._store: object | None = None

    def serve(self) -> None:
        """Start answering on the bound socket; workers that connected before wait in its backlog.

        Called after the workers are forked: the store's server thread would otherwise be running
        while the launcher forks, and a child forked while that thread holds a lock (malloc's, or
        libuv's) waits on it forever, which hangs every rank in ``init_process_group``.
        """
        import torch.distributed as dist  # already imported by __init__

        if self._store is None:
            kwargs = {"world_size": None, "is_master": True, "master_listen_fd": self.listen_fd,
                      "wait_for_workers": False, "timeout": timedelta(seconds=self._timeout)}
            try:
                self._store = dist.TCPStore(self.host, self.port, use_libuv=True, **kwargs)
            except NotImplementedError:
                # torch < 2.7: the libuv server cannot take a bound socket; the legacy one can (same protocol).
                self._store = dist.TCPStore(self.host, self.port, use_libuv=False, **kwargs)

    def close(self) -> None:
        """Stop the store and free the port."""
        if self._store is None and self.listen_fd >= 0:
            os.close(self.listen_fd)  # never served (starting the workers failed): the fd is still ours
        self.listen_fd = -1
        self._store = None


def is_port_in_use(port: int | None = None) -> bool:
    """Whether something on this machine accepts connections on ``port`` (Accelerate's default 29500).

    Example:
        >>> is_port_in_use(1)
        False
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        return probe.connect_ex(("localhost", 29500 if port is None else port)) == 0
