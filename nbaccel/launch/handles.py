"""`WorkerHandle`: the supervisor's view of one rank for one run: how it is read, polled and signalled.

A handle's run ends when :meth:`WorkerHandle.poll` says so. For a process started for this run
(the one-shot lifetime) that is the process's exit; other lifetimes subclass the handle: a Ray
actor's run (:mod:`nbaccel.launch.ray.handles`) or one task on a rank kept warm
(:mod:`nbaccel.launch.pool.task_handle`), whose run ends with its reply while the process lives on.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass, field
from typing import Any

from nbaccel.launch.events import RankState
from nbaccel.launch.frames import FrameReader

__all__ = ["WorkerHandle", "discard_workers", "open_pidfd"]


@dataclass
class WorkerHandle:
    """The supervisor's view of one worker process."""

    rank: int
    pid: int
    ctl_fd: int
    out_fd: int
    err_fd: int
    popen: subprocess.Popen[bytes] | None = None
    state: RankState = "starting"
    result: bytes | None = None
    error: dict[str, Any] | None = None
    exitcode: int | None = None
    signal: int | None = None
    exited: bool = False
    started_at: float | None = None
    result_at: float | None = None
    frames: FrameReader = field(default_factory=FrameReader)
    pidfd: int | None = None
    group: bool = False
    """The worker leads its own process group, which holds what it starts (subprocesses, loader workers)."""
    task_fd: int | None = None
    """A second frame channel of the run (a warm rank's task socket), read like ``ctl_fd``."""
    task_frames: FrameReader = field(default_factory=FrameReader)
    owns_fds: bool = True
    """The run owns the descriptors: the supervisor closes them when it is done (a warm rank's stay open)."""
    drain_wait: float = 0.05
    """How long, once the run ended, to wait for more output (a grandchild may still hold a pipe)."""

    def on_started(self) -> None:
        """The rank said ``started`` (a handle that holds a signal until then sends it now)."""

    def open_exit_fd(self) -> int | None:
        """A descriptor that becomes readable when the worker exits (a pidfd), or ``None``: exits are polled."""
        return open_pidfd(self.pid)

    def poll(self) -> bool:
        """Reap the process if it has exited; returns whether it has."""
        if self.exited:
            return True
        if self.popen is not None:
            code = self.popen.poll()
            if code is None:
                return False
            self.exitcode, self.signal = (None, -code) if code < 0 else (code, None)
        else:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                pid, status = self.pid, 0
            if pid == 0:
                return False
            if os.WIFSIGNALED(status):
                self.exitcode, self.signal = None, os.WTERMSIG(status)
            else:
                self.exitcode = os.waitstatus_to_exitcode(status)
        self.exited = True
        return True

    def send(self, sig: int) -> None:
        """Send ``sig`` to the worker alone, unless it is already gone."""
        if not self.exited:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def send_tree(self, sig: int) -> None:
        """Send ``sig`` to the worker and everything it started (its process group), when it has one."""
        if not self.group:
            self.send(sig)
        elif not self.exited:
            try:
                os.killpg(self.pid, sig)
            except (ProcessLookupError, PermissionError):
                self.send(sig)

    def kill_leftovers(self) -> None:
        """SIGKILL what the worker started and left running (its process group outlives it)."""
        if self.group:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def discard_workers(handles: list[WorkerHandle]) -> None:
    """Kill and reap workers that will never be supervised, and close their pipes.

    For a start that failed after some workers were running (a later fork refused, the
    rendezvous store failing, an interrupt): nothing may outlive the launch.
    """
    for handle in handles:
        handle.send_tree(signal.SIGKILL)
        if handle.popen is not None:
            handle.popen.wait()
        else:
            try:
                os.waitpid(handle.pid, 0)
            except ChildProcessError:
                pass
        handle.exited = True
        handle.kill_leftovers()
        for fd in (handle.ctl_fd, handle.out_fd, handle.err_fd):
            try:
                os.close(fd)
            except OSError:
                pass


def open_pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when ``pid`` exits, where Linux has them."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # not Linux >= 5.3: exits are found by polling
        return None
