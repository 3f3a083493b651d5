"""What a warm pool's owner reads from its workers: one selector over every rank's pipes and socket.

Each member has, on the owner's side, its stdout and stderr pipes (relayed through an
:class:`~nbaccel.launch.output.OutputRelay`), its control pipe, its task socket and a pidfd. These
descriptors are closed in every child this process forks later (``os.register_at_fork``), or a
later launch's workers would hold this pool's sockets open and closing the pool would not reach
its workers.
"""

from __future__ import annotations

import os
import selectors
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from nbaccel.launch.failures import RankError
from nbaccel.launch.frames import FrameReader
from nbaccel.launch.handles import WorkerHandle, open_pidfd
from nbaccel.launch.output import OutputRelay

__all__ = ["PoolChannels", "PoolEvent", "PoolMember"]

_READ_SIZE = 1 << 20
_owner_fds: set[int] = set()


def _close_owner_fds() -> None:
    for fd in list(_owner_fds):
        try:
            os.close(fd)
        except OSError:
            pass
    _owner_fds.clear()


os.register_at_fork(after_in_child=_close_owner_fds)


@dataclass
class PoolMember:
    """One rank of a pool, as its owner sees it.

    Attributes:
        rank: global rank.
        handle: its process (pid, pipes, exit status).
        sock: the task socket (``None`` until the worker connected).
        frames: reassembles the socket's messages.
        device: the device the worker reported once ready.
        error: what it reported raising while starting.
    """

    rank: int
    handle: WorkerHandle
    sock: socket.socket | None = None
    frames: FrameReader = field(default_factory=FrameReader)
    device: str = ""
    error: RankError | None = None
    ready: bool = False


# (member, kind, body): kind is a socket frame's kind, "ctl:<kind>" for a control-pipe frame, or "exit".
PoolEvent = tuple[PoolMember, str, Any]


class PoolChannels:
    """The selector over every member's descriptors; events come back from :meth:`pump`.

    Attributes:
        relay: where workers' output goes; replaced for each run (its ranks filter, its observer).
    """

    def __init__(self, members: Iterable[PoolMember]) -> None:
        self.members = list(members)
        self.relay = OutputRelay()
        self._selector = selectors.DefaultSelector()
        self._pidfd_ranks: set[int] = set()  # members whose exit wakes the selector (the rest are polled)
        for member in self.members:
            handle = member.handle
            for fd, kind in ((handle.ctl_fd, "ctl"), (handle.out_fd, "stdout"), (handle.err_fd, "stderr")):
                self._add(fd, member, kind)
            pidfd = open_pidfd(handle.pid)
            if pidfd is not None:
                self._add(pidfd, member, "exit")
                self._pidfd_ranks.add(member.rank)

    def _add(self, fd: int, member: PoolMember, kind: str) -> None:
        os.set_blocking(fd, False)
        self._selector.register(fd, selectors.EVENT_READ, (member, kind))
        _owner_fds.add(fd)

    def _drop(self, fd: int, close: bool = True) -> None:
        self._selector.unregister(fd)
        _owner_fds.discard(fd)
        if close:
            os.close(fd)

    def add_socket(self, member: PoolMember, sock: socket.socket) -> None:
        """Watch ``member``'s task socket (once it connected)."""
        member.sock = sock
        self._add(sock.fileno(), member, "task")

    def pump(self, wait: float) -> list[PoolEvent]:
        """Read whatever is ready within ``wait`` seconds; return the messages and exits it completed."""
        events: list[PoolEvent] = []
        for key, _ in self._selector.select(wait):
            member, kind = key.data
            events.extend(self._read(member, kind, key.fd))
        for member in self.members:  # where pidfds are missing, and to reap the exited
            if not member.handle.exited and member.rank not in self._pidfd_ranks and member.handle.poll():
                events.append((member, "exit", None))
        self.relay.tick()  # lines written less than a flush interval ago go out now
        return events

    def _read(self, member: PoolMember, kind: str, fd: int) -> list[PoolEvent]:
        if kind == "exit":
            self._drop(fd)
            self._pidfd_ranks.discard(member.rank)
            member.handle.poll()
            return [(member, "exit", None)]
        try:
            data = os.read(fd, _READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:  # a reset socket: the worker is gone; its exit says how
            data = b""
        if not data:
            self._drop(fd, close=kind != "task")  # the socket object closes its own descriptor
            return []
        if kind in ("stdout", "stderr"):
            self.relay.feed(member.rank, kind, data)  # type: ignore[arg-type]  # kind is a stream name here
            return []
        if kind == "ctl":
            return [(member, f"ctl:{k}", body) for k, body in member.handle.frames.feed(data)]
        return [(member, k, body) for k, body in member.frames.feed(data)]

    def drain(self, member: PoolMember) -> list[PoolEvent]:
        """Read what an exited member left in its pipes and socket; its last partial line is written out."""
        events: list[PoolEvent] = []
        own = {key.fd: key.data[1] for key in self._selector.get_map().values() if key.data[0] is member}
        for fd, kind in own.items():
            if kind == "exit":
                continue
            ready = selectors.DefaultSelector()
            ready.register(fd, selectors.EVENT_READ)
            # EOF comes at once from a pipe whose writer exited; silence means a grandchild still holds it
            while fd in self._selector.get_map() and ready.select(0.05):
                events.extend(self._read(member, kind, fd))
            ready.close()
        self.relay.flush_rank(member.rank)
        return events

    def close(self) -> None:
        """Stop watching; close every pipe and pidfd (sockets are closed by their owner)."""
        for key in list(self._selector.get_map().values()):
            self._drop(key.fd, close=key.data[1] != "task")
        self._selector.close()
        for member in self.members:
            if member.sock is not None:
                _owner_fds.discard(member.sock.fileno())
                member.sock.close()
