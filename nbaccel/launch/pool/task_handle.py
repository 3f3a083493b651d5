"""`TaskHandle`: one task on a rank kept warm, as the supervisor sees it (the keep-alive lifetime).

A warm rank's process outlives the task, so its handle reads the rank's pipes and task socket for
one task and says the run is over when the rank replied (``result`` or ``error``), or when its
process died. The supervisor's ``SIGTERM`` becomes ``SIGINT`` (``KeyboardInterrupt`` in the task);
``SIGKILL`` ends the rank and its pool (docs/architecture.md, Lifetimes). A cancel sent before the
rank said ``started`` waits for it: until then the task is not armed, and an interrupt would be
lost (see :mod:`nbaccel.launch.pool.serve`).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

from nbaccel.launch.failures import ProcessExit
from nbaccel.launch.handles import WorkerHandle, open_pidfd
from nbaccel.launch.pool.channels import PoolMember

__all__ = ["TaskHandle"]


@dataclass
class TaskHandle(WorkerHandle):
    """One task of pool member ``member``: ended by the rank's reply or its death (see the module docstring)."""

    member: PoolMember = field(default=None)  # type: ignore[assignment]  # always passed; a default because the base's fields have them
    armed: bool = False
    """The rank said ``started``: the task is armed, an interrupt reaches it."""
    cancel_pending: bool = False
    killed: bool = False
    """The supervisor killed the rank (it did not stop when cancelled): the rank is gone."""

    @classmethod
    def for_task(cls, member: PoolMember) -> TaskHandle:
        """The handle of the task about to be sent to ``member`` (its descriptors stay the pool's)."""
        process = member.handle
        assert member.sock is not None, "a pool member gets tasks only once it connected"
        return cls(rank=member.rank, pid=process.pid, ctl_fd=process.ctl_fd, out_fd=process.out_fd,
                   err_fd=process.err_fd, frames=process.frames, group=process.group, task_fd=member.sock.fileno(),
                   task_frames=member.frames, owns_fds=False, drain_wait=0.0, reply_ends_run=ProcessExit(exitcode=0),
                   member=member)

    def open_exit_fd(self) -> int | None:
        """A pidfd of the rank's process, for this task only (the supervisor closes it)."""
        return None if self.member.handle.exited else open_pidfd(self.pid)

    def poll(self) -> ProcessExit | None:
        """Whether the rank's process died (the task's end by the rank's reply is the supervisor's to see)."""
        return self.member.handle.poll()

    def send(self, sig: int) -> None:
        """Carry ``sig`` to the rank as the table in the module docstring says."""
        if self.member.handle.exited:
            return
        if sig in (signal.SIGTERM, signal.SIGINT):
            if not self.armed:
                self.cancel_pending = True  # sent when the rank says "started"
                return
            sig = signal.SIGINT
        self.member.handle.send(sig)

    def send_tree(self, sig: int) -> None:
        """``SIGKILL`` ends the rank with what it started; other signals go to the rank alone."""
        if sig == signal.SIGKILL:
            self.killed = self.killed or not self.member.handle.exited
            self.member.handle.send_tree(sig)
        else:
            self.send(sig)

    def on_started(self) -> None:
        """Arm the task; deliver a cancel that arrived before it was armed."""
        self.armed = True
        if self.cancel_pending:
            self.cancel_pending = False
            self.member.handle.send(signal.SIGINT)

    def kill_leftovers(self) -> None:
        """A rank that died leaves its process group behind; a live rank keeps what it started."""
        if self.member.handle.exited:
            self.member.handle.kill_leftovers()
