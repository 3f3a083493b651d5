"""The supervisor: owns a launch's workers from start to finish.

It reads every worker's output and control pipes in one loop on the caller's thread (so results
of any size are read while the workers run), notices exits, stops the other ranks after the first
failure, enforces the timeout and the hang watchdog, and on the caller's ``KeyboardInterrupt``
stops everything (SIGTERM, then SIGKILL after a grace period) before re-raising it. Whatever
happens, no worker outlives :meth:`Supervisor.run`. It is configured, not subclassed
(:class:`SupervisorPolicy`, an optional ``host``), and each rank's transport is its
:class:`WorkerHandle` (docs/architecture.md, Supervisor and Lifetimes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import selectors
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from nbaccel.errors import LaunchTimeoutError
from nbaccel.launch.events import LaunchObserver, RankState, as_observer
from nbaccel.launch.failures import ProcessExit, RankError, WorkerFailure, rank_failure
from nbaccel.launch.frames import DISPLAY_MARK
from nbaccel.launch.handles import REAP_TIMEOUT, WorkerHandle, wait_reaped
from nbaccel.launch.outcomes import RankOutcome, RunResult
from nbaccel.launch.output import OutputRelay
from nbaccel.launch.payload import load_result
from nbaccel.launch.run_log import begin_run_log

# What the supervisor itself sends when it stops ranks; any other death of a stopped rank is its own.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGKILL, signal.SIGINT)

__all__ = ["Supervisor", "SupervisorPolicy"]

_READ_SIZE = 1 << 20


@dataclass(frozen=True)
class SupervisorPolicy:
    """How a supervisor watches its workers.

    Attributes:
        timeout: seconds after which the launch is stopped (``None``: no limit).
        hang_timeout: after some ranks finished, seconds of silence from the rest before their
            stacks are dumped and they are stopped (``None``: no watchdog).
        grace: seconds between SIGTERM and SIGKILL when stopping workers.
        poll_interval: how often exits and deadlines are checked.
        host_name: how reports name the host process, where the ranks run inside one.
        keep_alive: the ranks outlive the run (a pool's): stopping them cancels their task
            (their handles carry that out, see :mod:`nbaccel.launch.pool.task_handle`), and reports
            say so.
        reap_timeout: seconds a killed rank may take to be reaped before the run names it as stuck in the kernel.
    """

    timeout: float | None = None
    hang_timeout: float | None = 120.0
    grace: float = 3.0
    poll_interval: float = 0.05
    host_name: str = "the host process"
    keep_alive: bool = False
    reap_timeout: float = REAP_TIMEOUT


class Supervisor:
    """Runs the loop that watches ``workers`` until every one of them is gone.

    Args:
        workers: the started workers, one per rank.
        relay: where their output goes.
        observer: optional status panel.
        policy: timeouts and grace period.
        host: a process that is not a rank but runs the ranks inside it (torch_xla's host): its
            exit ends the ranks that had not reported, it gets the stack-dump signal, and its own
            failure is reported only when no rank got as far as starting.
    """

    def __init__(self, workers: Sequence[WorkerHandle], relay: OutputRelay,
                 observer: LaunchObserver | None = None, *, policy: SupervisorPolicy | None = None,
                 host: WorkerHandle | None = None) -> None:
        self.workers = list(workers)
        self.relay = relay
        self.observer = as_observer(observer) or LaunchObserver()  # none given: the base class ignores every event
        self.policy = policy if policy is not None else SupervisorPolicy()
        self.host = host
        self._host_failure: WorkerFailure | None = None
        self._handles = ([host] if host is not None else []) + self.workers  # everything with a process
        self.outcomes = {h.rank: RankOutcome() for h in self._handles}
        self._pidfds: dict[int, int] = {}
        self._selector = selectors.DefaultSelector()
        self._last_activity = time.monotonic()
        self._stopped: list[int] = []
        self.run_log = begin_run_log()  # what workers post with accelerator.log ("log" frames)
        for handle in self._handles:
            task = [(handle.task_fd, "task")] if handle.task_fd is not None else []
            for fd, kind in [(handle.ctl_fd, "ctl"), (handle.out_fd, "stdout"), (handle.err_fd, "stderr"), *task]:
                os.set_blocking(fd, False)
                self._selector.register(fd, selectors.EVENT_READ, (handle, kind))
            pidfd = handle.open_exit_fd() if handle is host or host is None else None
            if pidfd is not None:  # wakes the loop the moment the worker exits
                self._pidfds[handle.rank] = pidfd
                self._selector.register(pidfd, selectors.EVENT_READ, (handle, "exit"))

    # ------------------------------------------------------------------ public
    def run(self, start: Callable[[], None] | None = None) -> RunResult:
        """Call ``start()`` (handing ranks their work), watch them; the values, or every rank's failure.

        An interrupt that lands while ``start`` runs, or right after it, stops the ranks like any other.

        Raises:
            KeyboardInterrupt: the caller was interrupted; every worker has been stopped.
            LaunchTimeoutError: ``timeout`` passed or the hang watchdog fired.
            LaunchError: a rank sent ``SIGKILL`` was not reaped within ``reap_timeout`` (stuck in the kernel).
        """
        started = time.monotonic()
        try:
            if start is not None:
                start()
            failures = self._watch(started)
        except BaseException:
            self._stop_all()
            raise
        finally:
            try:
                self._kill_remaining()
            finally:
                self._close()
                self.relay.flush()  # every line is out before the result or the failure
        n = len(self.workers)  # ranks, not the host
        if failures:
            # A rank stopped after the first failure that reported a failure of its own (its error was on the
            # way when the stop came) is reported as failed, never also as stopped.
            failed = {failure.rank for failure in failures}
            stopped = [r for r in self._stopped if (self.host is None or r != self.host.rank) and r not in failed]
            return RunResult(failures=tuple(failures), stopped=stopped, world_size=n)
        # Ranks whose value was not asked for reported an empty result: only that they finished.
        results = {h.rank: self.outcomes[h.rank].result for h in self.workers}
        return RunResult(values={r: load_result(r, data) for r, data in results.items() if data}, world_size=n)

    def _ended(self, handle: WorkerHandle) -> bool:
        return self.outcomes[handle.rank].exit is not None

    def _poll(self, handle: WorkerHandle) -> bool:
        """Whether ``handle``'s run is over: its process ended, or (where a reply ends it) it replied."""
        outcome = self.outcomes[handle.rank]
        if outcome.exit is None:
            outcome.exit = handle.poll() or (handle.reply_ends_run if outcome.replied else None)
        return outcome.exit is not None

    def _reap_exits(self, failures: list[WorkerFailure]) -> None:
        for handle in self._handles:
            if not self._ended(handle) and self._poll(handle) and (failure := self._on_exit(handle)) is not None:
                failures.append(failure)

    # ------------------------------------------------------------------ loop
    def _watch(self, started: float) -> list[WorkerFailure]:
        failures: list[WorkerFailure] = []
        stop_deadline: float | None = None
        grace = self.policy.grace
        while any(not self._ended(h) for h in self._handles):
            self._pump(self.policy.poll_interval)
            self._reap_exits(failures)
            now = time.monotonic()
            for handle in self._handles:  # returned, but stuck tearing down: its result stands
                result_at = self.outcomes[handle.rank].result_at
                if not self._ended(handle) and result_at is not None and now - result_at > grace + 2:
                    handle.send_tree(signal.SIGKILL)
            if failures and stop_deadline is None:
                # Ranks that already died (a SIGKILL, a segfault) are failures, not ranks we stopped:
                # reap them before stopping the rest, whichever exit was read first.
                self._reap_exits(failures)
                stop_deadline = now + grace
                self._terminate_running(signal.SIGTERM)
            elif stop_deadline is not None and now > stop_deadline:
                self._terminate_running(signal.SIGKILL)
            elif stop_deadline is None:
                self._check_deadlines(now, started)
        return failures

    def _pump(self, wait: float) -> None:
        for key, _ in self._selector.select(wait):
            if self._selector.get_map().get(key.fd) is not key:
                continue  # an earlier read of this batch consumed it (a display mark drains the control pipe)
            self._read(key.data[0], key.data[1], key.fd)
        self.relay.tick()  # lines written less than a flush interval ago go out now

    def _read(self, handle: WorkerHandle, kind: str, fd: int) -> bool:
        if kind == "exit":
            self._selector.unregister(fd)
            os.close(self._pidfds.pop(handle.rank))
            return False
        try:
            data = os.read(fd, _READ_SIZE)
        except BlockingIOError:
            return False
        except OSError:  # a reset socket: the rank is gone; its exit says how
            data = b""
        if not data:
            self._selector.unregister(fd)
            if handle.owns_fds:
                os.close(fd)
            return False
        self._last_activity = time.monotonic()
        if kind in ("ctl", "task"):
            for message in (handle.frames if kind == "ctl" else handle.task_frames).feed(data):
                self._on_message(handle, *message)
        elif kind == "stdout" and DISPLAY_MARK in data:
            while handle.ctl_fd in self._selector.get_map() and self._read(handle, "ctl", handle.ctl_fd):
                pass  # the display frame was written before its mark: it is in the control pipe
        if kind in ("stdout", "stderr"):
            self.relay.feed(handle.rank, kind, data)  # type: ignore[arg-type]  # kind is a stream name in this branch
        return True

    def _drain(self, handle: WorkerHandle) -> None:
        """Read what an exited worker left in its pipes (its write ends are closed now)."""
        deadline = time.monotonic() + 2.0
        if handle.rank in self._pidfds:
            self._read(handle, "exit", self._pidfds[handle.rank])
        fds = [fd for fd in (handle.ctl_fd, handle.out_fd, handle.err_fd, handle.task_fd)
               if fd is not None and fd in self._selector.get_map()]
        while fds and time.monotonic() < deadline:
            for fd in list(fds):
                if fd not in self._selector.get_map():
                    fds.remove(fd)
                    continue
                kind = self._selector.get_key(fd).data[1]
                if not self._read(handle, kind, fd) and fd in self._selector.get_map():
                    # no data now; EOF will follow unless a grandchild still holds the pipe
                    with selectors.DefaultSelector() as ready:
                        ready.register(fd, selectors.EVENT_READ)
                        if not ready.select(handle.drain_wait):
                            fds.remove(fd)
        self.relay.flush_rank(handle.rank)

    def _on_message(self, handle: WorkerHandle, kind: str, body: Any) -> None:
        outcome = self.outcomes[handle.rank]
        if kind == "started":
            handle.pid = body.get("pid", handle.pid)  # a replica reports its own process (inside the host)
            outcome.started_at = body["time"]
            self._set_state(handle, "running")
            handle.on_started()
        elif kind == "result":
            outcome.result, outcome.result_at = body, time.monotonic()
        elif kind == "error":
            outcome.error = RankError.from_frame(body)
        elif kind in ("display", "clear_output"):
            self.relay.queue_display(handle.rank, kind, body)  # type: ignore[arg-type]  # display or clear_output here
        elif kind == "log":
            for record in self.run_log.add(handle.rank, body):
                self.observer.on_log(handle.rank, record)

    def _set_state(self, handle: WorkerHandle, state: RankState) -> None:
        self.outcomes[handle.rank].state = state
        if handle is not self.host:
            self.observer.on_state(handle.rank, state)

    def _on_exit(self, handle: WorkerHandle) -> WorkerFailure | None:
        if self.host is None:
            return self._on_worker_exit(handle)
        return self._on_host_exit() if handle is self.host else self._on_hosted_exit(handle)

    def _on_worker_exit(self, handle: WorkerHandle) -> WorkerFailure | None:
        self._drain(handle)
        outcome = self.outcomes[handle.rank]
        error = outcome.error or handle.fallback_error()
        if outcome.result is not None and error is None and handle.rank not in self._stopped:
            self._set_state(handle, "finished")
            return None
        # a stopped rank that reported nothing, or only the KeyboardInterrupt that stopping it raised
        quiet = error is None or error.exc_type == "KeyboardInterrupt"
        ended = outcome.exit or ProcessExit()
        if handle.rank in self._stopped and quiet and ended.signal in (None, *_STOP_SIGNALS):
            self._set_state(handle, "stopped")
            return None
        self._set_state(handle, "failed")
        return rank_failure(handle.rank, handle.pid, ended, error)

    # ------------------------------------------------------------------ ranks inside a host process
    def _on_hosted_exit(self, handle: WorkerHandle) -> WorkerFailure | None:
        host = self.host
        assert host is not None
        self._drain(handle)  # a report may still be in the pipe
        if not self.outcomes[handle.rank].replied and handle.rank not in self._stopped:
            return self._unreported(handle)
        failure = self._on_worker_exit(handle)
        if all(self._ended(r) for r in self.workers) and not self._ended(host):
            self.outcomes[host.rank].result_at = time.monotonic()  # every rank is done: the host gets a grace
        return failure

    def _on_host_exit(self) -> WorkerFailure | None:
        host = self.host
        assert host is not None
        failure = self._on_worker_exit(host)
        for replica in self.workers:
            if not self._ended(replica):
                self._drain(replica)  # frames still in a pipe decide whether the rank reported
        if failure is None or any(self.outcomes[r.rank].state != "starting" for r in self.workers):
            self._host_failure = failure
            return None  # the ranks' own reports (or their absence) say what went wrong
        message = f"{self.policy.host_name} failed before any replica started: {failure.message}"
        return dataclasses.replace(failure, message=message)

    def _unreported(self, handle: WorkerHandle) -> WorkerFailure | None:
        host = self.host
        assert host is not None
        if self.outcomes[handle.rank].state == "starting":
            self._set_state(handle, "stopped")
            return None
        self._set_state(handle, "failed")
        said, known = "", self._host_failure
        if known is not None and known.exc_type:
            said = f" {self.policy.host_name} reported: {known.exc_type}: {known.message.strip().splitlines()[-1]}"
        in_host = handle.pid == host.pid  # a rank run inside the host itself: its exit is the host's
        failure = rank_failure(handle.rank, handle.pid, self.outcomes[host.rank].exit if in_host else None, None)
        return dataclasses.replace(
            failure, time=known.time if known is not None else failure.time,
            message="its process ended without reporting an exception (a crash in native code such as an XLA "
                    f"abort, an OOM kill, or os._exit); look for a faulthandler stack in the output above.{said}")

    # ------------------------------------------------------------------ deadlines
    def _check_deadlines(self, now: float, started: float) -> None:
        timeout, hang_timeout = self.policy.timeout, self.policy.hang_timeout
        if timeout is not None and now - started > timeout:
            what = "run" if self.policy.keep_alive else "launch"
            self._raise_stuck("timeout", f"the {what} ran past timeout={timeout:g}s")
        finished = [h for h in self.workers if self._ended(h)]
        if (hang_timeout is not None and finished and len(finished) < len(self.workers)
                and now - self._last_activity > hang_timeout):
            ranks = [h.rank for h in self.workers if not self._ended(h)]
            self._raise_stuck("hang", f"ranks {ranks} made no progress for {hang_timeout:g}s after "
                              f"ranks {[h.rank for h in finished]} finished")

    def _raise_stuck(self, reason: Literal["timeout", "hang"], what: str) -> None:
        stacks = self.dump_stacks()
        self._stop_all()
        shown = "\n".join(f"--- rank {r} ---\n{text}" for r, text in sorted(stacks.items()))
        stopped = "the run was cancelled in every rank" if self.policy.keep_alive else "every worker was stopped"
        raise LaunchTimeoutError(
            f"{what}; {stopped}. Python stacks of the ranks that were still running:\n{shown}\n"
            "Fix: look for a collective (all_reduce, barrier, gather) that only some ranks reach, or "
            "raise timeout=/hang_timeout= if the work is just slow.", stacks=stacks, reason=reason)

    def dump_stacks(self, wait: float = 1.0) -> dict[int, str]:
        """Ask every running worker for its Python stacks (SIGUSR1 + faulthandler) and collect them."""
        running = [h for h in self.workers if not self._ended(h) and self.outcomes[h.rank].state == "running"]
        self.relay.capturing = {h.rank for h in running} | ({self.host.rank} if self.host is not None else set())
        for handle in [self.host] if self.host is not None else running:  # the host's processes all dump theirs
            handle.send(signal.SIGUSR1)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            self._pump(0.05)
        self.relay.capturing = set()
        shared = "\n".join(self.relay.captured.pop(self.host.rank, [])) if self.host is not None else ""
        return {h.rank: "\n".join(self.relay.captured.pop(h.rank, [])) or shared for h in running}

    # ------------------------------------------------------------------ stopping
    def _terminate_running(self, sig: int) -> None:
        for handle in self._handles:
            if not self._ended(handle):
                if handle.rank not in self._stopped:
                    self._stopped.append(handle.rank)
                handle.send_tree(sig)

    def _stop_all(self) -> None:
        """SIGTERM every live worker and wait the grace period (a second interrupt skips it); run() kills the rest."""
        self._terminate_running(signal.SIGTERM)
        deadline = time.monotonic() + self.policy.grace
        with contextlib.suppress(KeyboardInterrupt):  # a second interrupt: run() kills what is left now
            while any(not self._ended(h) for h in self._handles) and time.monotonic() < deadline:
                with contextlib.suppress(OSError, ValueError):
                    self._pump(0.02)
                for handle in self._handles:
                    if self._poll(handle) and self.outcomes[handle.rank].state in ("starting", "running"):
                        self._set_state(handle, "stopped")

    def _kill_remaining(self) -> None:
        for handle in [h for h in self._handles if not self._ended(h)]:
            handle.send_tree(signal.SIGKILL)
        try:  # bounded: a process stuck in the kernel is named, not waited for forever
            wait_reaped(self._handles, self.policy.reap_timeout, ended=self._poll)
        finally:
            for handle in self._handles:  # a worker's subprocesses and loader workers end with the launch
                handle.kill_leftovers()
                if self.outcomes[handle.rank].state in ("starting", "running"):
                    self._set_state(handle, "stopped")

    def _close(self) -> None:
        for key in list(self._selector.get_map().values()):
            self._selector.unregister(key.fd)
            handle, kind = key.data
            if handle.owns_fds or kind == "exit":  # a warm rank's pipes and socket outlive the run
                with contextlib.suppress(OSError):
                    os.close(key.fd)
        self._selector.close()
