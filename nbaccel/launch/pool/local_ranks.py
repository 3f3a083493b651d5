"""A pool's ranks on this machine: started once, each run supervised as a launch is, kept between runs.

:func:`~nbaccel.launch.pool.start.start_pool` starts them; each run sends a ``task`` frame to every
rank and supervises one :class:`~nbaccel.launch.pool.task_handle.TaskHandle` per rank; a rank that
died (or was killed for not stopping) ends the pool. The Ray counterpart is
:class:`~nbaccel.launch.ray.pool.RayPoolRanks`; both are what :class:`~nbaccel.launch.pool.WorkerPool`
holds, behind the same five methods.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

from nbaccel.host_memory import resident_bytes
from nbaccel.launch.failures import ProcessExit
from nbaccel.launch.frames import write_frame
from nbaccel.launch.payload import dumps_payload
from nbaccel.launch.pool.channels import PoolMember
from nbaccel.launch.pool.start import PoolProcesses, start_pool
from nbaccel.launch.pool.task_handle import TaskHandle
from nbaccel.launch.request import LaunchRequest
from nbaccel.launch.supervised_run import SupervisedRun

__all__ = ["LocalPoolRanks", "describe_exit"]


class LocalPoolRanks:
    """The local side of a :class:`~nbaccel.launch.pool.WorkerPool` (see the module docstring).

    Attributes:
        lost: why the ranks cannot run any more (``None``: they can).
    """

    def __init__(self, processes: PoolProcesses) -> None:
        self.processes = processes
        self.lost: str | None = None

    @classmethod
    def start(cls, request: LaunchRequest, start_timeout: float) -> LocalPoolRanks:
        """Start ``request.num_processes`` ranks and wait until each joined the process group.

        Raises:
            WorkerFailedError: a rank failed while starting (nothing is left running).
            LaunchError: the ranks did not start within ``start_timeout`` (nothing is left running).
        """
        return cls(start_pool(request, start_timeout))

    @property
    def members(self) -> list[PoolMember]:
        """The ranks, by rank."""
        return self.processes.members

    def dead(self) -> str | None:
        """Why the pool cannot run (a rank's process is gone, even while idle), or ``None``."""
        if not self.lost:
            died = [m for m in self.members if m.handle.poll() is not None]
            if died:
                self.lost = "; ".join(describe_exit(m, "while idle") for m in died)
        return self.lost

    def workers(self) -> list[tuple[int, int, bool, str, int | None]]:
        """``(rank, pid, alive, device, resident bytes)`` per rank."""
        return [(m.rank, m.handle.pid, m.handle.poll() is None, m.device,
                 None if m.handle.exited else resident_bytes(m.handle.pid)) for m in self.members]

    def run(self, function: Callable[..., Any], args: Any, kwargs: Mapping[str, Any], *, run: SupervisedRun,
            result_ranks: Collection[int] | None) -> dict[int, Any]:
        """Run ``function`` on every rank; ``{rank: value}`` of ``result_ranks`` (all when ``None``).

        Raises:
            PayloadPicklingError: the function or an argument cannot be sent (nothing ran).
            BaseException: what a launch raises (the root-cause failure, a timeout, the interrupt);
                :attr:`lost` then says whether the ranks survived it.
        """
        return self.run_payload(dumps_payload(function, args, kwargs), run=run, result_ranks=result_ranks)

    def run_payload(self, payload: bytes, *, run: SupervisedRun,
                    result_ranks: Collection[int] | None) -> dict[int, Any]:
        """:meth:`run` with the cloudpickled ``(function, args, kwargs)`` made already."""
        handles = [TaskHandle.for_task(m) for m in self.members]

        def send_tasks() -> None:  # inside the supervisor's run: an interrupt from here on cancels the task
            with _interrupts_deferred():  # half a frame on a socket would break that rank's stream for good
                for member in self.members:
                    _send_task(member, payload, result_ranks is None or member.rank in result_ranks)

        try:
            return run.supervise(handles, start=send_tasks).get()
        finally:
            gone = [h for h in handles if h.member.handle.exited]
            if gone:
                killed = [h.rank for h in gone if h.killed]
                reasons = [describe_exit(h.member) for h in gone if not h.killed]
                if killed:
                    reasons.insert(0, f"ranks {killed} did not stop within {run.policy.grace:g}s of being cancelled "
                                      "and were killed")
                self.lost = "; ".join(reasons)
                self.processes.kill()  # the process group is broken: no rank may stay

    def shutdown(self) -> None:
        """End every rank and what it started; free the port and the folder (safe to call again)."""
        self.processes.shutdown()


def describe_exit(member: PoolMember, when: str = "") -> str:
    """How ``member``'s process ended, in words: its exit code or signal, and who sends that signal."""
    handle, suffix = member.handle, f" {when}" if when else ""
    ended = handle.reaped or ProcessExit()
    if ended.signal is None:
        return f"rank {member.rank} (pid {handle.pid}) exited with code {ended.exitcode}{suffix}"
    name = signal.Signals(ended.signal).name if ended.signal in signal.Signals._value2member_map_ else str(ended.signal)
    why = " (sent by the kernel's OOM killer, by someone's kill -9, or because the process that owns the pool " \
          "is ending)" if ended.signal == signal.SIGKILL else ""
    return f"rank {member.rank} (pid {handle.pid}) was killed by {name}{suffix}{why}"


def _send_task(member: PoolMember, payload: bytes, send_result: bool) -> None:
    """Write one task frame whole: the socket is non-blocking for the supervisor, blocking for this write."""
    fd = member.sock.fileno()  # type: ignore[union-attr]  # a started member has its socket
    os.set_blocking(fd, True)  # an idle rank reads at once; a payload larger than the buffer waits for it
    try:
        write_frame(fd, "task", (payload, send_result))
    finally:
        os.set_blocking(fd, False)


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """Hold a ``SIGINT`` that lands inside the block until it ends (main thread only; elsewhere none arrive)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught and previous is not signal.SIG_IGN:
            raise KeyboardInterrupt
