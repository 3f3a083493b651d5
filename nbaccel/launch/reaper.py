"""The group reaper: a tiny process that outlives a killed launcher and stops what its workers started.

Workers die with their launcher (``PR_SET_PDEATHSIG``), but what *they* started (a
``subprocess.Popen``, DataLoader worker processes) would not: those are the workers' children, and
nothing signals them when the launching kernel is SIGKILLed. Every local worker leads its own
process group, which holds everything it starts; the launcher tells this reaper which groups are
live (``watch`` / ``forget``) over a pipe. When the pipe closes without a goodbye (the launcher
died) the reaper SIGKILLs every group still watched, then exits.

One reaper per launching process, forked at its first launch (before any worker, and before the
rendezvous store's thread exists) and detached (double fork: it is not the launcher's child, so it
never shows up among the launcher's children or needs reaping by it); it holds only the pipe's
read end, ignores interrupts, and exits when the launcher exits, so no reaper is left behind.
"""

from __future__ import annotations

import os
import signal
import threading

__all__ = ["GroupReaper", "group_reaper"]

_lock = threading.Lock()
_reaper: GroupReaper | None = None


class GroupReaper:
    """The launcher's side of the reaper: register worker process groups while they run."""

    def __init__(self) -> None:
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # an intermediate child: the reaper is its child, so it is not the launcher's
            try:
                if os.fork() == 0:
                    _reap(read_end, write_end)  # never returns
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        os.close(read_end)
        os.set_inheritable(write_end, False)
        self.owner = os.getpid()
        self.fd = write_end

    def watch(self, pgid: int) -> None:
        """Kill group ``pgid`` if this process dies before :meth:`forget` is called for it."""
        self._send(b"+%d\n" % pgid)

    def forget(self, pgid: int) -> None:
        """Group ``pgid`` is over (its launch ended normally): never signal it."""
        self._send(b"-%d\n" % pgid)

    def _send(self, line: bytes) -> None:
        try:
            os.write(self.fd, line)  # a few bytes: atomic on a pipe
        except OSError:  # the reaper is gone (someone killed it): nothing else to do
            pass


def _reap(read_end: int, write_end: int) -> None:
    try:
        os.close(write_end)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Jupyter's interrupt is for the launcher
        os.setpgid(0, 0)  # and a signal to the launcher's group does not end the reaper early
        os.closerange(0, read_end)
        os.closerange(read_end + 1, 1 << 16)
        groups: set[int] = set()
        pending = b""
        while chunk := os.read(read_end, 4096):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                (groups.add if line[:1] == b"+" else groups.discard)(int(line[1:]))
        for pgid in groups:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except OSError:
                pass
    finally:
        os._exit(0)


def group_reaper() -> GroupReaper:
    """This process's reaper, started on first use (and again in a forked child that launches)."""
    global _reaper
    with _lock:
        if _reaper is None or _reaper.owner != os.getpid():
            _reaper = GroupReaper()
        return _reaper
