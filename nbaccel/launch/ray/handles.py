"""Ranks on Ray seen as local workers: the supervisor's handles, fed by a pump thread.

For a rank that is a Ray actor, :class:`RayRankHandle` holds the read ends of three local pipes,
and :class:`RunPump` (one thread per run) writes into them what each actor's
:meth:`~nbaccel.launch.ray.actor.RankActor.drain` returns, so the supervisor reads a Ray rank as
it reads a local one. Signals become Ray calls:

=========================  ==========================================================
``SIGINT``, ``SIGTERM``    ``KeyboardInterrupt`` in the rank's function (it may stop)
``SIGKILL``                ``ray.kill``: the actor is gone
``SIGUSR1``                the rank's Python stack, written to its stderr
=========================  ==========================================================

A handle "exits" when its run ends (the actor may live on, as in a pool), or when its actor dies.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from nbaccel.launch.failures import ProcessExit, RankError
from nbaccel.launch.handles import WorkerHandle

__all__ = ["RayRankHandle", "RunPump"]

_KILL_WAIT = 10.0  # seconds a killed actor's run may take to fail before the handle says so itself


@dataclass
class RayRankHandle(WorkerHandle):
    """The supervisor's view of one rank running in a Ray actor (see the module docstring)."""

    actor: Any = None
    ctl_w: int = -1
    out_w: int = -1
    err_w: int = -1
    exit_r: int = -1
    exit_w: int = -1
    killed_at: float | None = None
    died: str | None = None
    """Why the actor died, when it died of something else than the launcher's ``ray.kill``."""
    died_at: float = 0.0
    outcome: threading.Event = field(default_factory=threading.Event)
    code: int | None = None

    @classmethod
    def open(cls, rank: int, actor: Any, pid: int) -> RayRankHandle:
        """A handle with fresh pipes for one run of ``actor`` as rank ``rank``."""
        ctl_r, ctl_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        exit_r, exit_w = os.pipe()
        return cls(rank=rank, pid=pid, ctl_fd=ctl_r, out_fd=out_r, err_fd=err_r, actor=actor, ctl_w=ctl_w,
                   out_w=out_w, err_w=err_w, exit_r=exit_r, exit_w=exit_w)

    # ------------------------------------------------------------------ fed by the pump
    def deliver(self, ctl: bytes, out: bytes, err: bytes) -> None:
        """Write what the actor said into the pipes the supervisor reads (control first)."""
        for fd, data in ((self.ctl_w, ctl), (self.out_w, out), (self.err_w, err)):
            view = memoryview(data)
            while view and fd >= 0:
                try:
                    view = view[os.write(fd, view):]
                except BrokenPipeError:  # the supervisor is done reading
                    break

    def finish(self, code: int | None, died: str | None = None) -> None:
        """The run ended (``code``) or the actor died (``died``): EOF on every pipe, and wake the supervisor."""
        self.code, self.died, self.died_at = code, died, time.time()
        self._close(("ctl_w", "out_w", "err_w", "exit_w"))
        self.outcome.set()

    def _close(self, names: Sequence[str]) -> None:
        for name in names:
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)

    # ------------------------------------------------------------------ what the supervisor calls
    def open_exit_fd(self) -> int | None:
        """A descriptor that reads EOF when the run ends (the supervisor closes it)."""
        fd, self.exit_r = self.exit_r, -1
        return fd if fd >= 0 else None

    def fallback_error(self) -> RankError | None:
        """The actor's death, for a rank that reported nothing (a report read from the pipes wins)."""
        if self.died and self.killed_at is None:
            return RankError(time=self.died_at, message=f"its Ray actor died: {self.died}")
        return None

    def poll(self) -> ProcessExit | None:
        """How the run ended (or that the actor is gone), or ``None`` while it runs."""
        if self.reaped is not None:
            return self.reaped
        if not self.outcome.is_set():
            if self.killed_at is None or time.monotonic() - self.killed_at < _KILL_WAIT:
                return None
            self.finish(None, "killed, and its end was never confirmed by Ray")
        killed = self.killed_at is not None and self.code is None
        self.reaped = ProcessExit(signal=signal.SIGKILL) if killed else ProcessExit(exitcode=self.code)
        return self.reaped

    def send(self, sig: int) -> None:
        """Carry ``sig`` to the rank as the table in the module docstring says."""
        if self.exited or self.outcome.is_set():
            return
        if sig == signal.SIGKILL:
            import ray

            if self.killed_at is None:
                self.killed_at = time.monotonic()
                ray.kill(self.actor, no_restart=True)
        elif sig == signal.SIGUSR1:
            self.actor.dump_stacks.remote()
        elif sig in (signal.SIGINT, signal.SIGTERM):
            self.actor.interrupt.remote()

    def send_tree(self, sig: int) -> None:
        """As :meth:`send`: what the rank started lives and dies with its actor's process."""
        self.send(sig)

    def kill_leftovers(self) -> None:
        """Nothing to do: Ray ends an actor's process and the job's processes with it."""

    def close_writers(self) -> None:
        """Close the pump's ends of the pipes, if the run was abandoned before it ended."""
        self._close(("ctl_w", "out_w", "err_w", "exit_w", "exit_r"))


class RunPump:
    """One thread that carries every rank's bytes of run ``run_id`` from its actor to its handle."""

    def __init__(self, handles: Sequence[RayRankHandle], run_refs: Sequence[Any], run_id: int,
                 wait: float = 0.1) -> None:
        self._pending = {h.rank: (h, ref) for h, ref in zip(handles, run_refs)}
        self._run_id = run_id
        self._wait = wait
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="nbaccel-ray-pump", daemon=True)

    def start(self) -> RunPump:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop carrying (the supervisor has finished) and wait for the thread."""
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _loop(self) -> None:
        import ray

        while self._pending and not self._stop.is_set():
            ranks = list(self._pending)
            refs = [self._pending[r][1] for r in ranks]
            drains = [self._pending[r][0].actor.drain.remote(self._run_id, self._wait) for r in ranks]
            ended, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            for rank, drain in zip(ranks, drains):
                handle, ref = self._pending[rank]
                try:
                    handle.deliver(*ray.get(drain)[:3])
                except ray.exceptions.RayError:
                    ended.append(ref)  # the actor is gone: its run says why
            for rank in ranks:
                handle, ref = self._pending[rank]
                if ref in ended:
                    self._end(handle, ref)
                    del self._pending[rank]

    def _end(self, handle: RayRankHandle, ref: Any) -> None:
        import ray

        try:
            code = ray.get(ref)
            # the run returned only after its capture reached EOF: this is the rest of it
            handle.deliver(*ray.get(handle.actor.drain.remote(self._run_id, 0.0))[:3])
        except ray.exceptions.RayError as exc:
            handle.finish(None, _death_reason(exc))
            return
        handle.finish(code)


def _death_reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    reason = next((line.strip() for line in text if "died" in line.lower() or "exit" in line.lower()), "")
    return reason or (text[0] if text else type(exc).__name__)
