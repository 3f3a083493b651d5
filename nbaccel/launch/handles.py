"""`WorkerHandle`: the supervisor's view of one rank for one run: how it is read, polled and signalled.

A handle's run ends when :meth:`WorkerHandle.poll` says so: for a process started for this run,
its exit; subclasses end it otherwise (a Ray actor's call, :mod:`nbaccel.launch.ray.handles`; a
warm rank's reply, :mod:`nbaccel.launch.pool.task_handle`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from nbaccel.errors import LaunchError
from nbaccel.launch.failures import ProcessExit, RankError
from nbaccel.launch.frames import FrameReader

__all__ = ["REAP_TIMEOUT", "WorkerHandle", "discard_workers", "open_pidfd", "wait_reaped"]

REAP_TIMEOUT = 5.0
"""Seconds a process sent ``SIGKILL`` may take to be reaped before the wait gives up and says so."""


@dataclass
class WorkerHandle:
    """How the supervisor reaches one worker process: its descriptors, and how to poll and signal it.

    What the supervisor learns about the rank (its state, result, error) is not kept here: it is
    the supervisor's :class:`~nbaccel.launch.outcomes.RankOutcome`.
    """

    rank: int
    pid: int
    ctl_fd: int
    out_fd: int
    err_fd: int
    popen: subprocess.Popen[bytes] | None = None
    frames: FrameReader = field(default_factory=FrameReader)
    group: bool = False
    """The worker leads its own process group, which holds what it starts (subprocesses, loader workers)."""
    task_fd: int | None = None
    """A second frame channel of the run (a warm rank's task socket), read like ``ctl_fd``."""
    task_frames: FrameReader = field(default_factory=FrameReader)
    owns_fds: bool = True
    """The run owns the descriptors: the supervisor closes them when it is done (a warm rank's stay open)."""
    drain_wait: float = 0.05
    """How long, once the run ended, to wait for more output (a grandchild may still hold a pipe)."""
    reply_ends_run: ProcessExit | None = None
    """Set: the run is over once the rank replied (``result`` or ``error``), as this exit; its process lives on."""
    reaped: ProcessExit | None = field(default=None, init=False, repr=False)
    """The process's exit, once reaped (its pid may be reused after that: it is never signalled again)."""

    @property
    def exited(self) -> bool:
        """Whether the process has been reaped."""
        return self.reaped is not None

    def on_started(self) -> None:
        """The rank said ``started`` (a handle that holds a signal until then sends it now)."""

    def open_exit_fd(self) -> int | None:
        """A descriptor that becomes readable when the worker exits (a pidfd), or ``None``: exits are polled."""
        return open_pidfd(self.pid)

    def fallback_error(self) -> RankError | None:
        """What the transport knows of why the rank ended, for a rank that reported nothing (a dead actor)."""
        return None

    def poll(self) -> ProcessExit | None:
        """Reap the process if it has exited; how it ended, or ``None`` while it runs."""
        if self.reaped is not None:
            return self.reaped
        if self.popen is not None:
            code = self.popen.poll()
            if code is None:
                return None
            self.reaped = ProcessExit(signal=-code) if code < 0 else ProcessExit(exitcode=code)
            return self.reaped
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            pid, status = self.pid, 0
        if pid == 0:
            return None
        self.reaped = (ProcessExit(signal=os.WTERMSIG(status)) if os.WIFSIGNALED(status)
                       else ProcessExit(exitcode=os.waitstatus_to_exitcode(status)))
        return self.reaped

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

    Raises:
        LaunchError: a worker was still not reaped :data:`REAP_TIMEOUT` seconds after ``SIGKILL``.
    """
    for handle in handles:
        handle.send_tree(signal.SIGKILL)
    try:
        wait_reaped(handles, REAP_TIMEOUT)
    finally:
        for handle in handles:
            handle.kill_leftovers()
            for fd in (handle.ctl_fd, handle.out_fd, handle.err_fd):
                try:
                    os.close(fd)
                except OSError:
                    pass


def wait_reaped(handles: Sequence[WorkerHandle], within: float,
                ended: Callable[[WorkerHandle], bool] = lambda h: h.poll() is not None) -> None:
    """Wait until every one of ``handles`` (sent ``SIGKILL``) has ``ended``, for ``within`` seconds at most.

    A killed process ends at once unless it is stuck in the kernel (uninterruptible sleep, ``D``
    state: a hung driver, disk or network file system call): then the caller is told which, instead
    of waiting forever.

    Raises:
        LaunchError: some did not end within ``within`` seconds; it names their ranks and pids.
    """
    deadline = time.monotonic() + within
    while left := [h for h in handles if not ended(h)]:
        if time.monotonic() > deadline:
            who = ", ".join(f"rank {h.rank} (pid {h.pid})" for h in left)
            raise LaunchError(
                f"{who} did not exit within {within:g}s of SIGKILL: the process is stuck in the kernel (an "
                "uninterruptible sleep in a driver, disk or network file system call), so nbaccel stopped waiting "
                f"for it. It ends when that call returns. Fix: see where it waits with `cat /proc/{left[0].pid}/"
                f"stack` or `ps -o pid,stat,wchan -p {left[0].pid}`; if it never ends, restart the machine.")
        time.sleep(0.005)


def open_pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when ``pid`` exits, where Linux has them."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # not Linux >= 5.3: exits are found by polling
        return None
