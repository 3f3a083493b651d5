"""`LaunchRun`: the handle of one run, and starting a launch in the background (:func:`start_run`).

A background run's launch is the blocking launch, called on a thread of its own
(``nbaccel-run-<id>``); the kernel's main thread is free at once. What always holds:

- **Output** never reaches ``sys.stdout`` (in a kernel that is whichever cell executes now): the
  thread routes its relays to the run's :class:`~nbaccel.runs.record.RunRecord`
  (:func:`~nbaccel.launch.output.route_output`), and views show it (:meth:`LaunchRun.show`).
- **Interrupts**: Jupyter's Interrupt raises ``KeyboardInterrupt`` in the main thread only, and
  every rank leads its own process group, so a Ctrl-C in another cell never reaches the run.
  :meth:`LaunchRun.cancel` raises ``KeyboardInterrupt`` in the run's thread instead: the launch
  stops exactly as a blocking launch stops on Ctrl-C (every rank stopped; a pool's task
  cancelled and the pool kept). It waits until every rank has its task, as a pool defers an
  interrupt while it sends one (a half-sent task would break that rank's stream).
- **Devices**: the run holds its GPUs, the warm rank, or its pool until it ends
  (:mod:`nbaccel.launch.claims`); a launch that needs them is refused, naming the run.
- **Kernel exit**: running runs are cancelled at interpreter exit; their ranks die with the kernel
  anyway (``PR_SET_PDEATHSIG``, the group reaper).
"""

from __future__ import annotations

import ctypes
import io
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Literal, TextIO, cast

from nbaccel.launch.claims import Claim, claim, claimed_by_this_thread, release
from nbaccel.launch.output import OutputRoute, route_output
from nbaccel.runs.record import RankText, RunRecord
from nbaccel.runs.registry import add_run, next_run_id

__all__ = ["LaunchRun", "RunState", "run_blocking", "start_run"]

RunState = Literal["running", "finished", "failed", "cancelled"]
_TASK_WAIT = 5.0  # seconds cancel() waits for every rank to have its task before interrupting anyway


class _Discard(io.TextIOBase):
    """Where a background run's relays write: nowhere (its record has every line already)."""

    def write(self, text: str) -> int:
        return len(text)


class LaunchRun:
    """One run of this kernel: ``done()``, ``wait()``, ``result()``, ``cancel()``, ``output``, ``history``, ``show()``.

    Returned by ``notebook_launcher(..., background=True)``, ``WorkerPool.run(..., background=True)``
    and ``%%accel_launch --background``; ``%accel_runs`` lists every run of the kernel.

    Attributes:
        id: the run's number in this kernel (``%accel_runs show ID``).
        cell: where it was started (``"In[7]"``, or the function's name outside a notebook).
        num_processes: its ranks.
        background: whether it runs beside the kernel (a blocking cell's run is recorded too).
        record: its :class:`~nbaccel.runs.record.RunRecord`.

    Example:
        >>> run = notebook_launcher(train, num_processes=2, background=True)   # doctest: +SKIP
        >>> run.wait(); run.result()                                            # doctest: +SKIP
    """

    def __init__(self, run_id: int, cell: str, record: RunRecord, *, background: bool) -> None:
        self.id = run_id
        self.cell = cell
        self.record = record
        self.num_processes = len(record.records)
        self.background = background
        self.started = time.time()
        self.ended: float | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._outcome: tuple[str, Any] | None = None
        self._thread: threading.Thread | None = None
        self._in_launch = False
        self._cancelled = False

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> RunState:
        """``"running"``, ``"finished"``, ``"failed"`` or ``"cancelled"``."""
        if not self._done.is_set() or self._outcome is None:
            return "running"
        if self._outcome[0] == "value":
            return "finished"
        return "cancelled" if isinstance(self._outcome[1], KeyboardInterrupt) else "failed"

    def done(self) -> bool:
        """Whether the run has ended (finished, failed or cancelled)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the run ends, at most ``timeout`` seconds; whether it has ended."""
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> Any:
        """What the blocking launch would have returned, or raise what it would have raised.

        Raises:
            TimeoutError: the run did not end within ``timeout`` seconds (it goes on).
            BaseException: the launch's own exception: the ``WorkerFailedError`` family for a
                failing rank, ``KeyboardInterrupt`` after :meth:`cancel`, ``LaunchTimeoutError``, ...
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"run {self.id} is still running after {timeout:g} s (timeout={timeout!r}). Valid: "
                               "timeout=None waits until it ends. Fix: run.wait(), or run.result(timeout=None).")
        assert self._outcome is not None
        kind, value = self._outcome
        if kind == "error":
            raise value
        return value

    # ------------------------------------------------------------------ what it printed and logged
    @property
    def output(self) -> dict[int, RankText]:
        """``{rank: text}``: each rank's output, bounded; ``text.log_file`` holds all of it past the bound."""
        return {rank: self.record.output(rank) for rank in self.record.ranks()}

    @property
    def history(self) -> list[dict[str, Any]]:
        """What the ranks passed to ``accelerator.log``, one dict per call (as ``nbaccel.last_run_history()``)."""
        with self.record.lock:
            return [dict(r) for r in self.record.metrics]

    # ------------------------------------------------------------------ acting on it
    def cancel(self, timeout: float | None = None) -> bool:
        """Stop the run as Ctrl-C stops a blocking launch (every rank stopped; a pool stays); whether it was running.

        Returns once the run has ended (or ``timeout`` seconds passed: at interpreter exit).
        """
        if self._thread is None or self._done.is_set():
            return False
        deadline = time.monotonic() + _TASK_WAIT
        while time.monotonic() < deadline and not self._done.is_set() and self._starting():
            time.sleep(0.02)  # a task half-sent to a rank would break its stream: wait until each has it
        with self._lock:
            if self._in_launch and not self._cancelled and self._thread.ident is not None:
                self._cancelled = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._thread.ident),
                                                           ctypes.py_object(KeyboardInterrupt))
        self._done.wait(timeout)
        return True

    def _starting(self) -> bool:
        with self.record.lock:
            return any(r.state == "starting" for r in self.record.records.values())

    def show(self) -> None:
        """Show the run's live view in the current cell: status, output so far, live chart; it keeps updating."""
        from nbaccel.runs.view import show_run

        show_run(self)

    # ------------------------------------------------------------------ the run's thread
    def _main(self, launch: Callable[[], Any], held: Claim) -> None:
        claimed_by_this_thread(held)
        # _Discard is a text stream; io's classes just do not derive from typing.TextIO
        route = OutputRoute(cast(TextIO, _Discard()), cast(TextIO, _Discard()), self.record.on_display)
        outcome: tuple[str, Any] | None = None
        try:
            while outcome is None or self._in_launch:
                try:  # a cancel lands at most once, possibly just after the launch returned
                    if outcome is None:
                        try:
                            with route_output(route):
                                outcome = ("value", launch())
                        except BaseException as exc:  # noqa: BLE001 - handed to result()
                            outcome = ("error", exc)
                    with self._lock:
                        self._in_launch = False
                except KeyboardInterrupt as exc:
                    outcome = outcome or ("error", exc)
        finally:
            claimed_by_this_thread(None)
            release(held)
            self._settle(outcome or ("error", RuntimeError("the run's thread ended without an outcome")))

    def _settle(self, outcome: tuple[str, Any]) -> None:
        if self._cancelled and outcome[0] == "error" and type(outcome[1]) is KeyboardInterrupt and not outcome[1].args:
            outcome = ("error", KeyboardInterrupt(f"run {self.id} was cancelled (run.cancel()); "
                                                  "every rank was stopped"))
        self._outcome = outcome
        self.ended = time.time()
        if self.record.ok is None:  # the launch failed before its workers started: no on_end came
            self.record.end_record(outcome[0] == "value")
        self._done.set()

    # ------------------------------------------------------------------ text
    def elapsed(self) -> float:
        """Seconds since the run started (until it ended)."""
        return (self.ended if self.ended is not None else time.time()) - self.started

    def __repr__(self) -> str:
        how = "background" if self.background else "blocking"
        return (f"<LaunchRun {self.id}: {self.state}, "
                f"{self.num_processes} rank{'s' if self.num_processes != 1 else ''}, "
                f"{self.cell}, {how}, {self.elapsed():.1f} s; run.show() shows it live, %accel_runs lists runs>")


def start_run(launch: Callable[[], Any], record: RunRecord, *, cell: str, resources: Iterable[str]) -> LaunchRun:
    """Start ``launch()`` (a blocking launch reporting to ``record``) on a thread of its own; its handle at once.

    Raises:
        RunBusyError: another background run holds one of ``resources``.
    """
    run_id = next_run_id()
    run = LaunchRun(run_id, cell, record, background=True)
    held = claim(run_id, f"run {run_id} ({cell})", resources, cancel=run.cancel)
    run._in_launch = True
    run._thread = threading.Thread(target=run._main, args=(launch, held), name=f"nbaccel-run-{run_id}", daemon=True)
    add_run(run)
    run._thread.start()
    return run


def run_blocking(launch: Callable[[], Any], record: RunRecord, *, cell: str) -> Any:
    """Call ``launch()`` here, recorded as a run of the kernel (``%accel_runs show`` shows it again)."""
    run = LaunchRun(next_run_id(), cell, record, background=False)
    add_run(run)
    try:
        value = launch()
    except BaseException as exc:
        run._settle(("error", exc))
        raise
    run._settle(("value", None))  # the value stays with the cell, not with the kept run: it may be large
    return value
