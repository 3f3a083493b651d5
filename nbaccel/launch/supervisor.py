"""The supervisor: owns a launch's workers from start to finish.

It reads every worker's output and control pipes in one loop on the caller's thread (so results
of any size are read while the workers run), notices exits, stops the other ranks after the first
failure, enforces the timeout and the hang watchdog, and on the caller's ``KeyboardInterrupt``
stops everything (SIGTERM, then SIGKILL after a grace period) before re-raising it. Whatever
happens, no worker outlives :meth:`Supervisor.run`.

What varies between launchers is configuration, not subclassing: a :class:`SupervisorPolicy`
(timeouts, grace period, whether ranks outlive the run) and, where the ranks run inside another
process that nbaccel started (torch_xla's host process), that ``host`` handle. How one rank is
read, polled and signalled for this run is its :class:`WorkerHandle`'s business: a process started
for the run, a Ray actor's call, or one task on a rank kept warm (docs/architecture.md, Lifetimes).
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
from nbaccel.launch.events import LaunchObserver, RankState
from nbaccel.launch.failures import WorkerFailure, raise_failures
from nbaccel.launch.frames import DISPLAY_MARK
from nbaccel.launch.handles import WorkerHandle
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
    """

    timeout: float | None = None
    hang_timeout: float | None = 120.0
    grace: float = 3.0
    poll_interval: float = 0.05
    host_name: str = "the host process"
    keep_alive: bool = False


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
        self.observer = observer
        self.policy = policy if policy is not None else SupervisorPolicy()
        self.host = host
        self._host_failure: WorkerFailure | None = None
        self._handles = ([host] if host is not None else []) + self.workers  # everything with a process
        self._selector = selectors.DefaultSelector()
        self._last_activity = time.monotonic()
        self._stopped: list[int] = []
        self.run_log = begin_run_log()  # what workers post with accelerator.log ("log" frames)
        for handle in self._handles:
            task = [(handle.task_fd, "task")] if handle.task_fd is not None else []
            for fd, kind in [(handle.ctl_fd, "ctl"), (handle.out_fd, "stdout"), (handle.err_fd, "stderr"), *task]:
                os.set_blocking(fd, False)
                self._selector.register(fd, selectors.EVENT_READ, (handle, kind))
            handle.pidfd = handle.open_exit_fd() if handle is host or host is None else None
            if handle.pidfd is not None:  # wakes the loop the moment the worker exits
                self._selector.register(handle.pidfd, selectors.EVENT_READ, (handle, "exit"))

    # ------------------------------------------------------------------ public
    def run(self, start: Callable[[], None] | None = None) -> dict[int, Any]:
        """Call ``start()`` (handing ranks their work), watch them; ``{rank: result}`` or the root-cause failure.

        An interrupt that lands while ``start`` runs, or right after it, stops the ranks like any other.

        Raises:
            KeyboardInterrupt: the caller was interrupted; every worker has been stopped.
            LaunchTimeoutError: ``timeout`` passed or the hang watchdog fired.
            BaseException: the root-cause worker's exception (see :mod:`nbaccel.launch.failures`).
        """
        started = time.monotonic()
        try:
            if start is not None:
                start()
            failures = self._watch(started)
        except BaseException:
            self._stop_all(interrupted=True)
            raise
        finally:
            self._kill_remaining()
            self._close()
            self.relay.flush()  # every line is out before the result or the failure
        if failures:
            stopped = [r for r in self._stopped if self.host is None or r != self.host.rank]
            raise_failures(failures, len(self.workers), stopped)
        # Ranks whose value was not asked for reported an empty result: only that they finished.
        return {h.rank: load_result(h.rank, h.result) for h in self.workers if h.result}

    # ------------------------------------------------------------------ loop
    def _watch(self, started: float) -> list[WorkerFailure]:
        failures: list[WorkerFailure] = []
        stop_deadline: float | None = None
        grace = self.policy.grace
        while any(not h.exited for h in self._handles):
            self._pump(self.policy.poll_interval)
            for handle in self._handles:
                if not handle.exited and handle.poll():
                    failure = self._on_exit(handle)
                    if failure is not None:
                        failures.append(failure)
            now = time.monotonic()
            for handle in self._handles:  # returned, but stuck tearing down: its result stands
                if not handle.exited and handle.result_at is not None and now - handle.result_at > grace + 2:
                    handle.send_tree(signal.SIGKILL)
            if failures and stop_deadline is None:
                # Ranks that already died (a SIGKILL, a segfault) are failures, not ranks we stopped:
                # reap them before stopping the rest, whichever exit was read first.
                for handle in self._handles:
                    if not handle.exited and handle.poll():
                        failure = self._on_exit(handle)
                        if failure is not None:
                            failures.append(failure)
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
            handle, kind = key.data
            self._read(handle, kind, key.fd)
        self.relay.tick()  # lines written less than a flush interval ago go out now

    def _read(self, handle: WorkerHandle, kind: str, fd: int) -> bool:
        if kind == "exit":
            self._selector.unregister(fd)
            os.close(fd)
            handle.pidfd = None
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
            self.relay.feed(handle.rank, kind, data)
        else:
            self.relay.feed(handle.rank, kind, data)  # type: ignore[arg-type]  # kind is a stream name in this branch
        return True

    def _drain(self, handle: WorkerHandle) -> None:
        """Read what an exited worker left in its pipes (its write ends are closed now)."""
        deadline = time.monotonic() + 2.0
        if handle.pidfd is not None:
            self._read(handle, "exit", handle.pidfd)
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
                    ready = selectors.DefaultSelector()
                    ready.register(fd, selectors.EVENT_READ)
                    if not ready.select(handle.drain_wait):
                        fds.remove(fd)
                    ready.close()
        self.relay.flush_rank(handle.rank)

    def _on_message(self, handle: WorkerHandle, kind: str, body: Any) -> None:
        if kind == "started":
            handle.pid = body.get("pid", handle.pid)  # a replica reports its own process (inside the host)
            handle.started_at = body["time"]
            self._set_state(handle, "running")
            handle.on_started()
        elif kind == "result":
            handle.result = body
            handle.result_at = time.monotonic()
        elif kind == "error":
            handle.error = body
        elif kind in ("display", "clear_output"):
            self.relay.queue_display(handle.rank, kind, body)  # type: ignore[arg-type]  # display or clear_output here
        elif kind == "log":
            on_log = getattr(self.observer, "on_log", None)  # optional in the observer protocol
            for record in self.run_log.add(handle.rank, body):
                if on_log is not None:
                    on_log(handle.rank, record)

    def _set_state(self, handle: WorkerHandle, state: RankState) -> None:
        handle.state = state
        if self.observer is not None and handle is not self.host:
            self.observer.on_state(handle.rank, state)

    def _on_exit(self, handle: WorkerHandle) -> WorkerFailure | None:
        if self.host is None:
            return self._on_worker_exit(handle)
        return self._on_host_exit() if handle is self.host else self._on_hosted_exit(handle)

    def _on_worker_exit(self, handle: WorkerHandle) -> WorkerFailure | None:
        self._drain(handle)
        if handle.result is not None and handle.error is None and handle.rank not in self._stopped:
            self._set_state(handle, "finished")
            return None
        # a stopped rank that reported nothing, or only the KeyboardInterrupt that stopping it raised
        quiet = handle.error is None or handle.error.get("exc_type") == "KeyboardInterrupt"
        if handle.rank in self._stopped and quiet and handle.signal in (None, *_STOP_SIGNALS):
            self._set_state(handle, "stopped")
            return None
        self._set_state(handle, "failed")
        error = handle.error or {}
        if handle.signal is not None:
            message = ""
        elif handle.exitcode == 0:
            message = "exited with code 0 before returning (sys.exit(0) or os._exit(0) outside the function's return)"
        else:
            message = ("the process exited without reporting an exception "
                       "(os._exit, a crash in native code, or an OOM kill)")
        return WorkerFailure(
            rank=handle.rank, pid=handle.pid, time=error.get("time", time.time()), exitcode=handle.exitcode,
            signal=handle.signal, message=error.get("message", message),
            **{k: error[k] for k in ("exc_type", "traceback", "exception", "exception_note") if k in error})

    # ------------------------------------------------------------------ ranks inside a host process
    def _on_hosted_exit(self, handle: WorkerHandle) -> WorkerFailure | None:
        host = self.host
        assert host is not None
        self._drain(handle)  # a report may still be in the pipe
        if handle.result is None and handle.error is None and handle.rank not in self._stopped:
            return self._unreported(handle)
        failure = self._on_worker_exit(handle)
        if all(r.exited for r in self.workers) and not host.exited:
            host.result_at = time.monotonic()  # every rank is done: the host gets a grace to tear down
        return failure

    def _on_host_exit(self) -> WorkerFailure | None:
        host = self.host
        assert host is not None
        failure = self._on_worker_exit(host)
        for replica in self.workers:
            if not replica.exited:
                self._drain(replica)  # frames still in a pipe decide whether the rank reported
        if failure is None or any(r.state != "starting" for r in self.workers):
            self._host_failure = failure
            return None  # the ranks' own reports (or their absence) say what went wrong
        message = f"{self.policy.host_name} failed before any replica started: {failure.message}"
        return dataclasses.replace(failure, message=message)

    def _unreported(self, handle: WorkerHandle) -> WorkerFailure | None:
        host = self.host
        assert host is not None
        if handle.state == "starting":
            self._set_state(handle, "stopped")
            return None
        self._set_state(handle, "failed")
        said, known = "", self._host_failure
        if known is not None and known.exc_type:
            said = f" {self.policy.host_name} reported: {known.exc_type}: {known.message.strip().splitlines()[-1]}"
        in_host = handle.pid == host.pid  # a rank run inside the host itself: its exit is the host's
        return WorkerFailure(
            rank=handle.rank, pid=handle.pid, time=known.time if known is not None else time.time(),
            exitcode=host.exitcode if in_host else None, signal=host.signal if in_host else None,
            message="its process ended without reporting an exception (a crash in native code such as an XLA "
                    f"abort, an OOM kill, or os._exit); look for a faulthandler stack in the output above.{said}")

    # ------------------------------------------------------------------ deadlines
    def _check_deadlines(self, now: float, started: float) -> None:
        timeout, hang_timeout = self.policy.timeout, self.policy.hang_timeout
        if timeout is not None and now - started > timeout:
            what = "run" if self.policy.keep_alive else "launch"
            self._raise_stuck("timeout", f"the {what} ran past timeout={timeout:g}s")
        finished = [h for h in self.workers if h.exited]
        if (hang_timeout is not None and finished and len(finished) < len(self.workers)
                and now - self._last_activity > hang_timeout):
            ranks = [h.rank for h in self.workers if not h.exited]
            self._raise_stuck("hang", f"ranks {ranks} made no progress for {hang_timeout:g}s after "
                              f"ranks {[h.rank for h in finished]} finished")

    def _raise_stuck(self, reason: Literal["timeout", "hang"], what: str) -> None:
        stacks = self.dump_stacks()
        self._stop_all(interrupted=False)
        shown = "\n".join(f"--- rank {r} ---\n{text}" for r, text in sorted(stacks.items()))
        stopped = "the run was cancelled in every rank" if self.policy.keep_alive else "every worker was stopped"
        raise LaunchTimeoutError(
            f"{what}; {stopped}. Python stacks of the ranks that were still running:\n{shown}\n"
            "Fix: look for a collective (all_reduce, barrier, gather) that only some ranks reach, or "
            "raise timeout=/hang_timeout= if the work is just slow.", stacks=stacks, reason=reason)

    def dump_stacks(self, wait: float = 1.0) -> dict[int, str]:
        """Ask every running worker for its Python stacks (SIGUSR1 + faulthandler) and collect them."""
        running = [h for h in self.workers if not h.exited and h.state == "running"]
        self.relay.capturing = {h.rank for h in running}
        if self.host is not None:  # every process the host runs dumps all its threads
            self.relay.capturing.add(self.host.rank)
            self.host.send(signal.SIGUSR1)
        else:
            for handle in running:
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
            if not handle.exited:
                if handle.rank not in self._stopped:
                    self._stopped.append(handle.rank)
                handle.send_tree(sig)

    def _stop_all(self, interrupted: bool) -> None:
        """SIGTERM every live worker, SIGKILL after the grace period; a second interrupt skips the wait."""
        self._terminate_running(signal.SIGTERM)
        deadline = time.monotonic() + self.policy.grace
        try:
            while any(not h.exited for h in self._handles) and time.monotonic() < deadline:
                try:
                    self._pump(0.02)
                except (OSError, ValueError):
                    pass
                for handle in self._handles:
                    if handle.poll() and handle.state in ("starting", "running"):
                        self._set_state(handle, "stopped")
        except KeyboardInterrupt:
            pass
        self._kill_remaining()

    def _kill_remaining(self) -> None:
        for handle in [h for h in self._handles if not h.exited]:
            handle.send_tree(signal.SIGKILL)
        for handle in self._handles:
            while not handle.poll():
                time.sleep(0.005)
        for handle in self._handles:  # a worker's subprocesses and loader workers end with the launch
            handle.kill_leftovers()
            if handle.state in ("starting", "running"):
                self._set_state(handle, "stopped")

    def _close(self) -> None:
        for key in list(self._selector.get_map().values()):
            self._selector.unregister(key.fd)
            handle, kind = key.data
            if handle.owns_fds or kind == "exit":  # a warm rank's pipes and socket outlive the run
                with contextlib.suppress(OSError):
                    os.close(key.fd)
        self._selector.close()
