"""This host's memory and process facts: psutil's answers, capped by the memory cgroup that psutil does not read.

psutil (which Accelerate depends on too) answers what the kernel says: free memory
(``MemAvailable``), a process's resident memory, its open descriptors, a process group's live
members. nbaccel asks them here and nowhere else. What psutil leaves out is the container: in
Docker, Kubernetes, Colab or Kaggle the machine's free memory is not this process's: its memory
cgroup has a limit, and going past it gets the process OOM-killed, however much
``/proc/meminfo`` says is free. Both cgroup layouts are read, from the files the kernel exposes:

- v2 (one hierarchy, ``cgroup2`` in ``mountinfo``, ``0::/path`` in ``/proc/self/cgroup``):
  ``memory.max`` (``max`` means none), ``memory.current``, ``inactive_file`` in ``memory.stat``;
- v1 (a ``memory`` controller mount): ``memory.limit_in_bytes`` (a huge number means none),
  ``memory.usage_in_bytes``, ``total_inactive_file`` in ``memory.stat``.

What always holds: the process's cgroup and every ancestor up to the mount are read, and the
tightest one binds (a parent's limit caps its children); a cgroup's headroom is its limit minus
its usage less the inactive page cache (which the kernel reclaims before it OOM-kills, as
Docker's and the kubelet's "working set" count it); a file that is missing or unreadable is
skipped, never an error (no cgroup, not Linux, a hybrid layout whose v2 half has no memory
controller). psutil is imported on first use, not with nbaccel (it takes 20-50 ms). The two facts
every launch's preflight asks (free memory, open descriptors) are read on Linux from the same
``/proc`` files psutil reads, so a process's first launch does not pay that import
(``benchmarks/launch_trees.py``: an empty 2-process first launch went from 65 to 118 ms with it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["CgroupMemory", "available_memory", "cgroup_memory", "group_members", "open_descriptors", "resident_bytes"]

UNLIMITED = 2**60  # v1 writes "no limit" as PAGE_COUNTER_MAX pages (about 2**63 bytes)
_FILES = {  # layout -> (limit, usage, the inactive page-cache key in memory.stat)
    "v2": ("memory.max", "memory.current", "inactive_file"),
    "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
}


@dataclass(frozen=True)
class CgroupMemory:
    """The memory cgroup whose limit binds this process.

    Attributes:
        path: its directory, e.g. ``/sys/fs/cgroup/memory/docker/<id>``.
        layout: ``"v1"`` or ``"v2"``.
        limit: its limit in bytes.
        usage: what counts against the limit now, in bytes (inactive page cache left out).
    """

    path: str
    layout: str
    limit: int
    usage: int

    @property
    def headroom(self) -> int:
        """Bytes the cgroup may still take before the kernel reclaims or OOM-kills."""
        return max(0, self.limit - self.usage)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _mounts(proc: str) -> list[tuple[str, str, str, set[str]]]:
    """``(layout, hierarchy root, mount point, super options)`` of each cgroup mount."""
    found = []
    for line in (_read(os.path.join(proc, "mountinfo")) or "").splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        tail = line.split(" - ", 1)[1].split()
        if len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        layout = "v2" if tail[0] == "cgroup2" else "v1"
        mount_point = fields[4].replace("\\040", " ")
        found.append((layout, fields[3], mount_point, set(tail[2].split(","))))
    return found


def _memory_dirs(proc: str) -> list[tuple[str, str, str]]:
    """``(layout, this process's cgroup directory, its mount point)`` for each memory hierarchy."""
    paths: dict[str, str] = {}
    for line in (_read(os.path.join(proc, "cgroup")) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            paths["v2"] = parts[2]
        elif "memory" in parts[1].split(","):
            paths["v1"] = parts[2]
    dirs = []
    for layout, root, mount_point, options in _mounts(proc):
        if layout not in paths or (layout == "v1" and "memory" not in options):
            continue
        path = paths[layout]
        if root == "/":
            inside = path
        elif path == root or path.startswith(root + "/"):
            inside = path[len(root):]
        else:  # the process's cgroup is not under what is mounted: the mount's own is the nearest
            inside = ""
        dirs.append((layout, os.path.normpath(mount_point + "/" + inside.lstrip("/")), mount_point))
    return dirs


def _level(layout: str, directory: str) -> CgroupMemory | None:
    """The limit and usage of one cgroup directory, or ``None`` without a limit."""
    limit_file, usage_file, inactive_key = _FILES[layout]
    limit_text, usage_text = _read(os.path.join(directory, limit_file)), \
        _read(os.path.join(directory, usage_file))
    if limit_text is None or usage_text is None or limit_text == "max":
        return None
    try:
        limit, usage = int(limit_text), int(usage_text)
    except ValueError:
        return None
    if limit >= UNLIMITED:
        return None
    for line in (_read(os.path.join(directory, "memory.stat")) or "").splitlines():
        key, _, value = line.partition(" ")
        if key == inactive_key and value.strip().isdigit():
            usage = max(0, usage - int(value))
    return CgroupMemory(directory, layout, limit, usage)


def cgroup_memory(proc: str = "/proc/self") -> CgroupMemory | None:
    """The memory cgroup (this process's, or an ancestor's) with the least headroom.

    Args:
        proc: where to read ``cgroup`` and ``mountinfo`` (a test points it at its own files).

    Returns:
        The binding cgroup, or ``None`` when no memory cgroup sets a limit.

    Example:
        >>> found = cgroup_memory()
        >>> found is None or found.limit > 0
        True
    """
    tightest: CgroupMemory | None = None
    for layout, directory, mount_point in _memory_dirs(proc):
        while True:
            level = _level(layout, directory)
            if level is not None and (tightest is None or level.headroom < tightest.headroom):
                tightest = level
            if directory == mount_point or len(directory) <= len(mount_point):
                break
            directory = os.path.dirname(directory)
    return tightest


def _meminfo_available() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo`` in bytes (psutil's ``available`` on Linux), ``None`` elsewhere."""
    try:
        with open("/proc/meminfo", "rb") as meminfo:
            for line in meminfo:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_memory(proc: str = "/proc/self", free: int | None = None) -> int:
    """Bytes this process may still take: the least of the free memory and its cgroup's headroom.

    Args:
        proc: where to read ``cgroup`` and ``mountinfo`` (a test points it at its own files).
        free: the machine's free memory; default ``MemAvailable`` (psutil's ``available`` where there is none).

    Example:
        >>> available_memory() > 0
        True
    """
    if free is None:
        free = _meminfo_available()
    if free is None:
        import psutil

        free = psutil.virtual_memory().available
    limited = cgroup_memory(proc)
    return free if limited is None else min(free, limited.headroom)


def resident_bytes(pid: int | None = None) -> int | None:
    """A process's resident memory in bytes (this one's by default), ``None`` when it is gone or unreadable.

    Example:
        >>> resident_bytes() > 0
        True
    """
    import psutil

    try:
        rss = psutil.Process(pid).memory_info().rss
    except psutil.Error:  # gone, or not ours to read
        return None
    return rss or None  # a zombie keeps no memory; /proc lists no resident size for it, so "unknown", not 0


def open_descriptors() -> int | None:
    """How many file descriptors this process has open, ``None`` where the system does not say.

    Example:
        >>> open_descriptors() >= 3   # stdin, stdout, stderr at least
        True
    """
    try:
        return len(os.listdir("/proc/self/fd"))  # what psutil counts on Linux (its own listing included)
    except OSError:  # not Linux
        pass
    import psutil

    try:
        return psutil.Process().num_fds()
    except (psutil.Error, AttributeError):  # AttributeError: no num_fds (Windows)
        return None


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``."""
    import psutil

    members = []
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                members.append(proc.pid)
        except OSError:  # exited since it was listed
            continue
    return members
