"""One task on a warm pool: send it to every rank, relay output, collect every rank's reply.

What always holds when :func:`run_task` returns or raises: every rank has replied and waits for
the next task, or the pool is dead (``TaskOutcome.dead``) and every worker has been killed.

- A rank raises: the others get ``grace`` seconds to reply on their own, then are cancelled
  (``SIGINT``: ``KeyboardInterrupt`` inside their task). The root cause is raised as the
  :class:`~nbaccel.errors.WorkerFailedError` family, and the pool stays.
- The caller is interrupted (or ``timeout`` passes): every rank still running is cancelled.
- A rank that does not reply within ``grace`` of being cancelled (stuck in a collective, in
  native code) is killed, and with it the pool: its process group cannot be trusted any more.
- A worker dies (exit, signal, OOM): the pool is dead; the others are killed.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from nbaccel.errors import LaunchTimeoutError
from nbaccel.launch.events import LaunchObserver
from nbaccel.launch.failures import WorkerFailure, format_report, raise_failures
from nbaccel.launch.frames import write_frame
from nbaccel.launch.payload import loads
from nbaccel.launch.pool.channels import PoolChannels, PoolMember
from nbaccel.launch.pool.start import exit_failure

__all__ = ["TaskOutcome", "run_task"]

_POLL = 0.05


@dataclass
class TaskOutcome:
    """What happened to one task, beyond its results: set when the pool died during it.

    Attributes:
        dead: why the pool is dead (``""``: it is alive).
        cancelled: the ranks sent ``SIGINT`` (an interrupt, the timeout, or another rank's failure).
    """

    dead: str = ""
    cancelled: list[int] = field(default_factory=list)


class _Collector:
    def __init__(self, channels: PoolChannels, members: Sequence[PoolMember], observer: LaunchObserver | None,
                 grace: float, outcome: TaskOutcome) -> None:
        self.channels = channels
        self.members = list(members)
        self.observer = observer
        self.grace = grace
        self.outcome = outcome
        self.results: dict[int, bytes] = {}
        self.errors: dict[int, dict[str, Any]] = {}
        self.deaths: list[WorkerFailure] = []
        self.started: set[int] = set()
        self.cancelling = False

    def replied(self, member: PoolMember) -> bool:
        return member.rank in self.results or member.rank in self.errors

    def waiting(self) -> list[PoolMember]:
        return [m for m in self.members if not self.replied(m)]

    def step(self, wait: float) -> None:
        for member, kind, body in self.channels.pump(wait):
            self.on_event(member, kind, body)

    def on_event(self, member: PoolMember, kind: str, body: Any) -> None:
        if kind == "started":
            self.started.add(member.rank)
            self._state(member.rank, "running")
            if self.cancelling:
                member.handle.send(signal.SIGINT)
        elif kind == "result" and not self.replied(member):
            self.results[member.rank] = body
            self._state(member.rank, "finished")
        elif kind == "error" and not self.replied(member):
            self.errors[member.rank] = body
            cancelled = member.rank in self.outcome.cancelled and body.get("exc_type") == "KeyboardInterrupt"
            self._state(member.rank, "stopped" if cancelled else "failed")
        elif kind == "ctl:error":
            member.handle.error = body
        elif kind == "exit":
            for event in self.channels.drain(member):  # a reply may still be in the socket
                self.on_event(*event)
            self.deaths.append(exit_failure(member, member.handle.error))
            self._state(member.rank, "failed")

    def _state(self, rank: int, state: Any) -> None:
        if self.observer is not None:
            self.observer.on_state(rank, state)

    def cancel(self) -> None:
        """``SIGINT`` every rank still running; a rank that has not said ``started`` yet gets it when it does."""
        self.cancelling = True
        for member in self.waiting():
            if member.rank not in self.outcome.cancelled:
                self.outcome.cancelled.append(member.rank)
            if member.rank in self.started:
                member.handle.send(signal.SIGINT)

    def wait(self, seconds: float) -> bool:
        """Collect replies for up to ``seconds``; whether every rank replied (no death)."""
        deadline = time.monotonic() + seconds
        while self.waiting() and not self.deaths and time.monotonic() < deadline:
            self.step(_POLL)
        return not self.waiting() and not self.deaths

    def kill_stragglers(self, why: str) -> None:
        late = [m.rank for m in self.waiting()]
        self.outcome.dead = f"ranks {late} {why} and were killed"
        for member in self.members:
            member.handle.send(signal.SIGKILL)

    def end_after_deaths(self) -> None:
        """A worker died: the pool is dead (its process group is broken); stop the others."""
        self.outcome.dead = "; ".join(f.summary for f in self.deaths)
        for member in self.members:
            member.handle.send(signal.SIGKILL)

    def failures(self) -> list[WorkerFailure]:
        """Every rank's failure: its reported exception (not the interrupt it was cancelled with), or its death."""
        own = []
        for member in self.members:
            error = self.errors.get(member.rank)
            if error is None or (member.rank in self.outcome.cancelled and error["exc_type"] == "KeyboardInterrupt"):
                continue
            own.append(WorkerFailure(rank=member.rank, pid=member.handle.pid, time=error["time"],
                                     exc_type=error["exc_type"], message=error["message"],
                                     traceback=error["traceback"], exception=error["exception"]))
        return own + self.deaths


def run_task(channels: PoolChannels, members: Sequence[PoolMember], payload: bytes, *, observer: LaunchObserver | None,
             grace: float, timeout: float | None, outcome: TaskOutcome,
             result_ranks: Collection[int] | None = None) -> dict[int, Any]:
    """Run the cloudpickled ``payload`` on every member; ``{rank: result}`` or the root-cause failure.

    Only the ranks in ``result_ranks`` (all when ``None``) send their return value; the others
    report only that they finished, so a value the caller did not ask for is never pickled, sent
    or unpickled here.

    Raises:
        KeyboardInterrupt: the caller was interrupted; the running task was cancelled in every rank.
        LaunchTimeoutError: ``timeout`` passed; the task was cancelled.
        WorkerFailedError: a rank raised (the pool stays), or died (``outcome.dead`` says the pool is dead).
    """
    run = _Collector(channels, members, observer, grace, outcome)
    if observer is not None:
        observer.on_launch([m.rank for m in members], "pool")
    ok = False
    try:
        with _interrupts_deferred():  # half a frame on a socket would break that rank's stream for good
            for member in members:
                wanted = result_ranks is None or member.rank in result_ranks
                write_frame(member.sock.fileno(), "task", (payload, wanted))  # type: ignore[union-attr]
        _collect(run, timeout)
        ok = True
    except KeyboardInterrupt:
        _settle(run, "did not stop within {grace:g}s of the interrupt")
        note = f"; {outcome.dead}, so the pool is dead: restart it" if outcome.dead else \
            "; the running task was cancelled in every rank and the pool is still up"
        raise KeyboardInterrupt(f"interrupted{note}") from None
    finally:
        channels.relay.flush()  # every line of the task is out before its result or failure
        if observer is not None:
            observer.on_end(ok and not run.errors and not run.deaths)
    failures = run.failures()
    if failures:
        raise_failures(failures, len(members), run.outcome.cancelled)
    # An empty result is a rank whose value was not asked for: it finished, nothing more.
    return {rank: loads(data) for rank, data in sorted(run.results.items()) if data}


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


def _settle(run: _Collector, why: str) -> None:
    """Cancel whoever still runs, give them ``grace`` to reply, kill the pool if they do not."""
    run.cancel()
    try:
        run.wait(run.grace)
    except KeyboardInterrupt:  # a second interrupt: stop waiting
        pass
    if run.deaths:
        run.end_after_deaths()
    elif run.waiting():
        run.kill_stragglers(why.format(grace=run.grace))


def _collect(run: _Collector, timeout: float | None) -> None:
    started = time.monotonic()
    failed_at: float | None = None
    while run.waiting() and not run.deaths:
        run.step(_POLL)
        now = time.monotonic()
        if run.errors and failed_at is None:
            failed_at = now
        if failed_at is not None and run.waiting() and now - failed_at > run.grace:
            _settle(run, "did not stop within {grace:g}s of being cancelled after another rank failed")
            return
        if timeout is not None and now - started > timeout:
            _settle(run, "did not stop within {grace:g}s of being cancelled at the timeout")
            report = format_report(run.failures()) if run.failures() else ""
            dead = f" {run.outcome.dead}, so the pool is dead: restart it." if run.outcome.dead else \
                " The task was cancelled in every rank; the pool is still up."
            raise LaunchTimeoutError(f"the task ran past timeout={timeout:g}s.{dead} {report}".rstrip(),
                                     stacks={}, reason="timeout")
    if run.deaths:
        run.end_after_deaths()
