"""Who may talk to a launch's rendezvous store: the launch's own ranks, checked on connect.

A ``TCPStore`` has no authentication: on loopback every local user could read the keys the ranks
exchange and write values rank 0 reads. So ranks connect to a front (``127.0.0.1:MASTER_PORT``)
that asks the kernel (sock_diag) who holds each connecting socket: it must belong to this user
and to one of the launch's own worker processes, else it is closed. One thread relays checked
connections to the real store, whose socket filter drops every connection whose source is not
one of the relay's own ports, so going around the front does not work either.

What always holds once :meth:`StoreGuard.start` returned: every connection the real store serves
is the store's own or one the relay made for a checked rank. A port is added to the filter before
the relay's socket connects and removed before it closes, so a freed port never lets in whoever
binds it next. Where the kernel answers neither by netlink nor in ``/proc/net/tcp`` (not Linux)
the front cannot check, and accepts (said in SECURITY.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import selectors
import socket
import struct
import threading
from collections.abc import Callable, Collection

from nbaccel.errors import LaunchError
from nbaccel.launch.loopback_sockets import loopback_sockets

__all__ = ["StoreGuard"]

_SO_ATTACH_FILTER = 26
_SKF_NET_OFF = -0x100000
_LOOPBACK = 0x7F000001


def _filter_program(ports: Collection[int]) -> list[tuple[int, int, int, int]]:
    """Classic BPF: accept a packet only from 127.0.0.1 and one of ``ports`` (TCP data starts at its header)."""
    program = [(0x20, 0, 0, (_SKF_NET_OFF + 12) & 0xFFFFFFFF),  # A = source address
               (0x15, 1, 0, _LOOPBACK), (0x06, 0, 0, 0),        # not 127.0.0.1: drop
               (0x28, 0, 0, 0)]                                 # A = source port
    for port in sorted(ports):
        program += [(0x15, 0, 1, port), (0x06, 0, 0, 0xFFFFFFFF)]  # one of ours: accept
    return [*program, (0x06, 0, 0, 0)]


def _attach_filter(sock: socket.socket, ports: Collection[int]) -> None:
    program = _filter_program(ports)
    code = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *ins) for ins in program))
    sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER,
                    struct.pack("HxxxxxxQ", len(program), ctypes.addressof(code)))  # copied by the kernel


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
    return inodes


class StoreGuard:
    """The front a rendezvous store is reached through; see the module docstring.

    Args:
        host: the loopback address.
        port: the front's port (``MASTER_PORT``); ``0`` picks a free one.

    Raises:
        OSError: ``port`` cannot be bound (the caller turns ``EADDRINUSE`` into its own error).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.front = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.front.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.real = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self.front.bind((host, port))
            self.real.bind((host, 0))
        except OSError:
            self.front.close()
            self.real.close()
            raise
        self.front.listen(512)
        self.real.listen(512)
        self.port: int = self.front.getsockname()[1]
        self.real_port: int = self.real.getsockname()[1]
        self.rejected: list[tuple[int, str]] = []  # (peer port, why): for tests and reports
        self._allowed_pids: frozenset[int] = frozenset()
        self._relay_ports: set[int] = set()
        self._pairs: dict[socket.socket, socket.socket] = {}
        self._wake_r, self._wake_w = os.pipe()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def fds(self) -> list[int]:
        """The descriptors a forked worker must close (they are the launcher's)."""
        return [self.front.fileno(), self.real.fileno(), self._wake_r, self._wake_w]

    def start(self, make_store: Callable[[int], object], ranks: Collection[int]) -> object:
        """Lock the real store's port, build the store on it, and start relaying for the processes ``ranks``.

        Args:
            make_store: builds the ``TCPStore`` server on the listening descriptor it is given.
            ranks: the pids of the launch's own workers: only their sockets pass the front.

        Raises:
            LaunchError: a process other than this one connected to the real store before it was locked.
        """
        self._allowed_pids = frozenset(ranks)
        store = make_store(os.dup(self.real.fileno()))  # the store connects its own client now
        _attach_filter(self.real, self._relay_ports)
        self._refuse_strangers()
        self._thread = threading.Thread(target=self._relay, name="nbaccel-store-guard", daemon=True)
        self._thread.start()
        return store

    def _refuse_strangers(self) -> None:
        served = loopback_sockets(self.real_port)
        if served is None:
            return
        own = _socket_inodes(os.getpid())
        strangers = []
        for client_port, _, _, state in served:
            if state != 1:  # not ESTABLISHED: the listener itself, or a closing socket
                continue
            client = loopback_sockets(client_port, self.real_port) or []
            if not any(inode in own for _, _, inode, _ in client):
                strangers.append(client_port)
        if strangers:
            raise LaunchError(f"a process other than this launcher connected to the rendezvous store (from "
                              f"port {strangers[0]}) in the moment before it was locked; the launch was stopped. "
                              "Fix: launch again (the store's port is new each time); if it recurs, look for a "
                              "local process scanning ports.")

    def _check(self, peer_port: int) -> str:
        """Why the connection from ``peer_port`` is refused, or ``""``."""
        rows = loopback_sockets(peer_port, self.port)
        if rows is None:
            return ""
        if not rows:
            return "the kernel lists no such socket"
        _, uid, inode, _ = rows[0]
        if uid != os.getuid():
            return f"it belongs to uid {uid}"
        if self._allowed_pids and not any(inode in _socket_inodes(pid) for pid in self._allowed_pids):
            return "it is not one of the launch's workers"
        return ""

    def _accept(self, selector: selectors.BaseSelector) -> None:
        try:
            conn, (_, peer_port) = self.front.accept()
        except (BlockingIOError, InterruptedError):
            return
        why = self._check(peer_port)
        if why:
            self.rejected.append((peer_port, why))
            conn.close()
            return
        upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        upstream.bind((self.host, 0))
        port = upstream.getsockname()[1]
        with self._lock:
            self._relay_ports.add(port)
            _attach_filter(self.real, self._relay_ports)
        try:
            upstream.connect((self.host, self.real_port))
        except OSError:  # the store is gone (closing): its port must not stay open to the next owner
            self._forget_ports([upstream])
            upstream.close()
            conn.close()
            return
        for end in (conn, upstream):  # the store's requests are small: Nagle's delay would add 40 ms to each
            end.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for a, b in ((conn, upstream), (upstream, conn)):
            self._pairs[a] = b
            selector.register(a, selectors.EVENT_READ)

    def _relay(self) -> None:
        selector = selectors.DefaultSelector()
        self.front.setblocking(False)
        selector.register(self.front, selectors.EVENT_READ)
        selector.register(self._wake_r, selectors.EVENT_READ)
        try:
            while True:
                for key, _ in selector.select():
                    if key.fileobj == self._wake_r:
                        return
                    if key.fileobj is self.front:
                        self._accept(selector)
                    else:
                        self._pump(selector, key.fileobj)  # type: ignore[arg-type]  # every other registered file object is a socket
        finally:
            self._forget_ports(list(self._pairs))  # the store may outlive the relay: no port stays open
            for sock in list(self._pairs):
                sock.close()
            selector.close()

    def _pump(self, selector: selectors.BaseSelector, sock: socket.socket) -> None:
        other = self._pairs.get(sock)
        if other is None:
            return
        try:
            data = sock.recv(1 << 16)
            if data:
                other.sendall(data)
                return
        except OSError:
            pass
        ends = (sock, other)  # one side closed: close the pair
        self._forget_ports(ends)
        for end in ends:
            selector.unregister(end)
            self._pairs.pop(end, None)
            end.close()

    def _forget_ports(self, ends: Collection[socket.socket]) -> None:
        """Shut the real port's filter to the relay ports among ``ends`` while they are still bound.

        Re-armed before the sockets close, not at the next accept: once closed, a port is free for
        anyone to bind (another user included), and the filter only checks source ports.
        """
        ports = set()
        for end in ends:
            with contextlib.suppress(OSError):
                ports.add(end.getsockname()[1])
        with self._lock:
            if not ports & self._relay_ports:
                return
            self._relay_ports -= ports
            _attach_filter(self.real, self._relay_ports)

    def close(self) -> None:
        """Stop relaying and close every socket (the store itself is closed by its owner)."""
        if self._thread is not None and self._thread.ident is not None:  # an interrupt can land inside start()
            os.write(self._wake_w, b"x")
            self._thread.join(timeout=5)
        self._thread = None
        for sock in (self.front, self.real):
            sock.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
