"""Helpers to look at processes, descriptors and sockets from /proc (Linux)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

BEFORE_THIS_TEST: set[int] = set()
"""This process's children when the running test started (tests/conftest.py sets it): a leftover of
an earlier test, or a module-scoped pool's worker, is not the running test's business."""


def children(pid: int | None = None) -> list[int]:
    """Live (non-zombie) direct children of ``pid`` (default: this process, less those from before this test)."""
    if pid is None:
        return [c for c in all_children() if c not in BEFORE_THIS_TEST]
    return all_children(pid)


def all_children(pid: int | None = None) -> list[int]:
    """Live (non-zombie) direct children of ``pid`` (default: this process), the group reaper left out."""
    pid = os.getpid() if pid is None else pid
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:
            continue
    return [c for c in out if alive(c) and not _is_group_reaper(c)]


def _is_group_reaper(pid: int) -> bool:
    """The launcher's one long-lived helper process (nbaccel.launch.reaper), not a worker."""
    from nbaccel.launch.reaper import MARKER

    try:
        return MARKER.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def open_fds(pid: int | None = None) -> set[int]:
    """Open file descriptor numbers of ``pid``."""
    pid = os.getpid() if pid is None else pid
    return {int(fd) for fd in os.listdir(f"/proc/{pid}/fd")}


def socket_inodes(pid: int) -> set[str]:
    """Inodes of the sockets ``pid`` holds."""
    out = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def listening(inodes: set[str] | None = None) -> list[tuple[str, int]]:
    """``(address, port)`` of TCP sockets in LISTEN state (optionally only those with ``inodes``)."""
    found = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            parts = line.split()
            local, state, inode = parts[1], parts[3], parts[9]
            if state != "0A" or (inodes is not None and inode not in inodes):
                continue
            addr_hex, port_hex = local.split(":")
            if v6:
                addr = "::1" if addr_hex.endswith("01000000") and addr_hex.startswith("0000") else (
                    "::" if set(addr_hex) == {"0"} else addr_hex)
                if addr_hex == "0000000000000000FFFF00000100007F":
                    addr = "127.0.0.1"
            else:
                addr = ".".join(str(int(addr_hex[i:i + 2], 16)) for i in (6, 4, 2, 0))
            found.append((addr, int(port_hex, 16)))
    return found


def handlers() -> dict[int, object]:
    """This process's Python-level signal handlers."""
    return {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT,
                                             signal.SIGCHLD, signal.SIGUSR1)}
