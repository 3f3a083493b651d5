"""The group reaper: a tiny process that outlives a killed launcher and stops what its workers started.

Workers die with their launcher (``PR_SET_PDEATHSIG``), but their own children would not. Every
local worker leads its own process group; the launcher tells this reaper which groups (and pool
folders) are live over a pipe (``watch`` / ``forget``). When the pipe closes (the launcher exited
or died) the reaper SIGKILLs every group still watched, removes every folder still watched, and
exits. One reaper per launching process, started at its first launch (``python -S``, not waited
for); it ignores interrupts, sits in its own session, and its command line carries :data:`MARKER`.
"""

from __future__ import annotations

import os
import sys
import threading

__all__ = ["MARKER", "GroupReaper", "group_reaper", "remove_watched_folders"]

MARKER = "nbaccel-group-reaper"
"""In the reaper's command line, so tools (and tests) can tell it from a worker."""

_lock = threading.Lock()
_reaper: GroupReaper | None = None

# The reaper's program: read "+pgid" / "-pgid" (a process group) and ">path" / "<path" (a private
# folder) lines until EOF, then SIGKILL the groups and remove the folders still registered.
_PROGRAM = f"""# {MARKER}
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
fd, groups, folders, pending = int(sys.argv[1]), set(), set(), b""
while True:
    chunk = os.read(fd, 4096)
    if not chunk:
        break
    pending += chunk
    *lines, pending = pending.split(b"\\n")
    for line in lines:
        op, arg = line[:1], line[1:]
        if op in (b"+", b"-"):
            (groups.add if op == b"+" else groups.discard)(int(arg))
        elif op in (b">", b"<"):
            (folders.add if op == b">" else folders.discard)(os.fsdecode(arg))
for pgid in groups:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
if folders:  # shutil only then: its import is a fifth of the reaper's start, beside a launch's first forks
    import shutil
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
"""


class GroupReaper:
    """The launcher's side of the reaper: register worker process groups while they run."""

    def __init__(self) -> None:
        read_end, write_end = os.pipe()
        try:
            os.set_inheritable(read_end, True)
            # posix_spawn, not Popen: nothing here ever waits for the reaper (it outlives this process
            # by design), and a Popen object would warn that it was left running.
            self.pid = os.posix_spawn(
                sys.executable, [sys.executable, "-S", "-c", _PROGRAM, str(read_end), MARKER], dict(os.environ),
                file_actions=[(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_RDWR, 0) for fd in (0, 1, 2)],
                setsid=True)
        finally:
            os.close(read_end)
        os.set_inheritable(write_end, False)
        self.owner = os.getpid()
        self.fd = write_end
        self.folders: set[str] = set()  # what the reaper would remove: also removed here when this process ends

    def watch(self, pgid: int) -> None:
        """Kill group ``pgid`` if this process dies before :meth:`forget` is called for it."""
        self._send(b"+%d\n" % pgid)

    def forget(self, pgid: int) -> None:
        """Group ``pgid`` is over (its launch ended normally): never signal it."""
        self._send(b"-%d\n" % pgid)

    def watch_folder(self, path: str) -> None:
        """Remove the folder ``path`` (a pool's socket folder) if this process dies before :meth:`forget_folder`.

        Raises:
            ValueError: ``path`` holds a newline (the reaper reads one entry per line).
        """
        self._send(b">" + _one_line(path) + b"\n")
        self.folders.add(path)

    def forget_folder(self, path: str) -> None:
        """The folder ``path`` was removed by its owner: leave it alone."""
        self._send(b"<" + _one_line(path) + b"\n")
        self.folders.discard(path)

    def _send(self, line: bytes) -> None:
        try:
            os.write(self.fd, line)  # a few bytes: atomic on a pipe
        except OSError:  # the reaper is gone (someone killed it): nothing else to do
            pass


def _one_line(path: str) -> bytes:
    raw = os.fsencode(path)
    if b"\n" in raw:
        raise ValueError(f"the reaper cannot watch a folder whose path holds a newline (got {path!r}). "
                         "Fix: use a temporary folder without one (set TMPDIR).")
    return raw


def remove_watched_folders() -> None:
    """Remove the folders this process's reaper watches, now: a worker ending its descendants ends its reaper too.

    A launch's rank that holds a pool (or a warm rank) kills everything it started when it ends,
    its own reaper included, so that reaper never gets to remove the pool's folder: the rank does.
    """
    reaper = _reaper
    if reaper is None or reaper.owner != os.getpid() or not reaper.folders:
        return
    import shutil

    for folder in list(reaper.folders):
        shutil.rmtree(folder, ignore_errors=True)
        reaper.forget_folder(folder)


def group_reaper() -> GroupReaper:
    """This process's reaper, started on first use (and again in a forked child that launches)."""
    global _reaper
    with _lock:
        if _reaper is None or _reaper.owner != os.getpid():
            _reaper = GroupReaper()
        return _reaper
