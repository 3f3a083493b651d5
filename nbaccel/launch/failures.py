"""Worker failures as data, and how they are raised in the caller, root cause first.

The earliest failure is the root cause. A worker that raised is re-raised in the caller as the
same exception type with its message; the remote traceback is chained as ``__cause__`` and the
report travels on the exception as ``launch_failures``. Failures that cannot be re-raised that
way (``os._exit``, a signal, an exception that does not unpickle) raise
:class:`~nbaccel.errors.WorkerFailedError` / :class:`~nbaccel.errors.ProcessExitedError`.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

from nbaccel.errors import ProcessExitedError, WorkerFailedError
from nbaccel.launch.payload import loads

__all__ = ["RemoteTraceback", "WorkerFailure", "format_report", "raise_failures"]


@dataclass(frozen=True)
class WorkerFailure:
    """One failed worker.

    Attributes:
        rank: global rank of the worker.
        pid: its process id.
        time: when it failed (``time.time()``).
        exitcode: its exit code, or ``None`` if it was killed by a signal or is unknown.
        signal: the signal number that killed it, if any.
        exc_type: qualified name of the exception it raised (``""`` when none was reported).
        message: ``str()`` of that exception, or a description of the exit.
        traceback: the remote traceback text (``""`` when none).
        exception: the pickled exception, when it could be pickled.
    """

    rank: int
    pid: int
    time: float
    exitcode: int | None = None
    signal: int | None = None
    exc_type: str = ""
    message: str = ""
    traceback: str = ""
    exception: bytes | None = None

    @property
    def summary(self) -> str:
        """One line: rank, and exception or exit status."""
        if self.exc_type:
            return f"rank {self.rank} (pid {self.pid}) raised {self.exc_type}: {self.message}"
        if self.signal is not None:
            name = signal.Signals(self.signal).name if self.signal in signal.Signals._value2member_map_ else self.signal
            return f"rank {self.rank} (pid {self.pid}) was killed by signal {name}"
        return f"rank {self.rank} (pid {self.pid}) exited with code {self.exitcode}: {self.message}"


class RemoteTraceback(Exception):
    """Carries a worker's traceback text so it prints as the cause of the re-raised error."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n" + self.text.rstrip()


def _sorted(failures: Sequence[WorkerFailure]) -> list[WorkerFailure]:
    # A reported exception beats a bare exit at the same moment: the exit is often the echo.
    return sorted(failures, key=lambda f: (f.time, 0 if f.exc_type else 1, f.rank))


def format_report(failures: Sequence[WorkerFailure], stopped: Sequence[int] = ()) -> str:
    """A readable report: the root cause first, then the other ranks, identical errors grouped."""
    ordered = _sorted(failures)
    root, rest = ordered[0], ordered[1:]
    lines = [f"root cause: {root.summary}"]
    groups: dict[tuple[str, str], list[int]] = {}
    for failure in rest:
        groups.setdefault((failure.summary.split(") ", 1)[-1], failure.traceback), []).append(failure.rank)
    for (summary, _), ranks in groups.items():
        label = "rank" if len(ranks) == 1 else "ranks"
        lines.append(f"also failed: {label} {', '.join(map(str, ranks))}: {summary}")
    if stopped:
        lines.append(f"stopped by nbaccel after the failure: ranks {', '.join(map(str, sorted(stopped)))}")
    return "\n".join(lines)


def raise_failures(failures: Sequence[WorkerFailure], world_size: int,
                   stopped: Sequence[int] = ()) -> NoReturn:
    """Raise the root cause in the caller.

    Raises:
        BaseException: the root-cause worker's own exception type, when it could be rebuilt.
        ProcessExitedError: the root cause exited or was killed without reporting an exception.
        WorkerFailedError: the root cause's exception could not be rebuilt here.
    """
    ordered = tuple(_sorted(failures))
    root = ordered[0]
    report = format_report(ordered, stopped)
    if root.exception is not None:
        try:
            exc = loads(root.exception)
        except Exception:  # noqa: BLE001 - fall back to a generic error below
            exc = None
        if isinstance(exc, BaseException):
            exc.launch_failures = ordered  # type: ignore[attr-defined]
            if hasattr(exc, "add_note"):
                exc.add_note(f"[nbaccel] {report}\n[nbaccel] world size {world_size}; the traceback "
                             f"above the line is rank {root.rank}'s, in the worker.")
            raise exc.with_traceback(None) from RemoteTraceback(root.traceback)
    if not root.exc_type:
        raise ProcessExitedError(f"{report}\n(world size {world_size})", ordered)
    raise WorkerFailedError(f"{report}\n\n{root.traceback}", ordered) from None
