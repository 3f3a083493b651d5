"""The rendezvous store of a single-machine launch: hosted by the launcher, on loopback only, for its own ranks.

The launcher binds the store's sockets on ``127.0.0.1`` itself (port 0: back-to-back launches never
collide) and hands the real one to a ``TCPStore`` it owns; workers join as clients through the
front that :mod:`nbaccel.launch.store_guard` puts before it. The ports are released when the launch ends.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Collection
from datetime import timedelta
from typing import Any

from nbaccel.errors import LaunchError
from nbaccel.launch.store_guard import StoreGuard

__all__ = ["LoopbackStore", "is_port_in_use"]


class LoopbackStore:
    """A ``TCPStore`` listening on ``host`` only, owned by this process, reached only by the launch's ranks.

    Args:
        port: the port the workers connect to (``MASTER_PORT``); ``0`` picks a free one.
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
        import torch.distributed  # noqa: F401 - imported for its side effect, see above
        try:
            self.guard = StoreGuard(host, port)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise LaunchError(f"port {port} on {host} is already in use. Fix: pass another "
                                  "use_port, or leave it unset so nbaccel picks a free port.") from None
            raise
        self.host = host
        self.port: int = self.guard.port
        self._timeout = timeout
        self._store: object | None = None

    @property
    def listen_fds(self) -> list[int]:
        """The launcher's descriptors a forked worker must close."""
        return self.guard.fds

    def serve(self, ranks: Collection[int] = ()) -> None:
        """Start answering; workers that connected before wait in the front's backlog.

        Args:
            ranks: the pids of the launch's workers, the only processes whose connections pass.

        Called after the workers are forked: the store's server thread would otherwise be running
        while the launcher forks, and a child forked while that thread holds a lock (malloc's, or
        libuv's) waits on it forever, which hangs every rank in ``init_process_group``.

        Raises:
            LaunchError: another process reached the store before it was locked (see store_guard).
        """
        if self._store is None:
            self._store = self.guard.start(self._tcp_store, ranks)

    def _tcp_store(self, listen_fd: int) -> object:
        """The ``TCPStore`` server on the guard's real socket (``listen_fd``, a duplicate it owns)."""
        import torch.distributed as dist  # already imported by __init__

        kwargs: dict[str, Any] = {"world_size": None, "is_master": True, "master_listen_fd": listen_fd,
                  "wait_for_workers": False, "timeout": timedelta(seconds=self._timeout)}
        try:
            return dist.TCPStore(self.host, self.guard.real_port, use_libuv=True, **kwargs)
        except NotImplementedError:
            # torch < 2.7: the libuv server cannot take a bound socket; the legacy one can (same protocol).
            return dist.TCPStore(self.host, self.guard.real_port, use_libuv=False, **kwargs)

    @property
    def rejected(self) -> list[tuple[int, str]]:
        """Connections the front closed: ``(peer port, why)``."""
        return self.guard.rejected

    def close(self) -> None:
        """Stop the store and free the ports."""
        self.guard.close()
        self._store = None


def is_port_in_use(port: int | None = None) -> bool:
    """Whether something on this machine accepts connections on ``port`` (Accelerate's default 29500).

    Example:
        >>> is_port_in_use(1)
        False
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        return probe.connect_ex(("localhost", 29500 if port is None else port)) == 0
