"""Worker failures as data, and how they are raised in the caller, root cause first.

Every launcher reports failures as :class:`WorkerFailure` records and raises them here, so a
failed launch has one shape everywhere: an exception of the
:class:`~nbaccel.errors.WorkerFailedError` family carrying every rank's failure on ``failures``,
root cause (the earliest) first. A worker's ``Exception`` is re-raised as its own type joined with
``WorkerFailedError``, the remote traceback chained as ``__cause__``
(:mod:`nbaccel.launch.rank_exceptions`); other ends (``os._exit``, a signal, an exception that
cannot be rebuilt) raise :class:`~nbaccel.errors.ProcessExitedError` or ``WorkerFailedError``,
saying why. A report cuts a huge message or traceback in the middle; the exception keeps it whole.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from nbaccel.errors import ProcessExitedError, WorkerFailedError
from nbaccel.launch.rank_exceptions import in_family, unpack_exception

__all__ = ["MESSAGE_LIMIT", "TRACEBACK_LIMIT", "ProcessExit", "RankError", "RemoteTraceback", "WorkerFailure",
           "format_report", "raise_failures", "rank_failure", "shorten"]

MESSAGE_LIMIT = 4_000
"""The most characters of a rank's exception message a report quotes (the exception itself keeps all of it)."""
TRACEBACK_LIMIT = 20_000
"""The most characters of a rank's traceback text a report carries."""


def shorten(text: str, limit: int) -> str:
    """``text``, or its start and end around a note of what was left out when it is longer than ``limit``.

    Example:
        >>> shorten("x" * 50, 20)
        'xxxxxxxxxxxxxxx [... 30 of 50 characters left out ...] xxxxx'
    """
    if len(text) <= limit:
        return text
    head, tail = limit * 3 // 4, limit // 4
    note = f" [... {len(text) - head - tail:,} of {len(text):,} characters left out ...] "
    return text[:head] + note + text[len(text) - tail:]


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
        exception: the pickled exception (or its parts), when it could be sent.
        exception_note: why the exception could not be rebuilt in the caller as its own type (``""``
            when it was, or when the rank raised none).
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
    exception_note: str = ""

    @property
    def summary(self) -> str:
        """One line: rank, and exception or exit status."""
        if self.exc_type:
            return f"rank {self.rank} (pid {self.pid}) raised {self.exc_type}: {self.message}"
        if self.signal is not None:
            name = signal.Signals(self.signal).name if self.signal in signal.Signals._value2member_map_ else self.signal
            return f"rank {self.rank} (pid {self.pid}) was killed by signal {name}"
        return f"rank {self.rank} (pid {self.pid}) exited with code {self.exitcode}: {self.message}"


@dataclass(frozen=True)
class ProcessExit:
    """How a rank's process (or its run) ended: an exit code, or the signal that killed it (both ``None``: unknown)."""

    exitcode: int | None = None
    signal: int | None = None


@dataclass(frozen=True)
class RankError:
    """What a rank reported when its function raised (an ``error`` frame), as a typed value.

    Attributes: as :class:`WorkerFailure`'s fields of the same names.
    """

    time: float
    exc_type: str = ""
    message: str = ""
    traceback: str = ""
    exception: bytes | None = None
    exception_note: str = ""

    @classmethod
    def from_frame(cls, body: Mapping[str, Any]) -> RankError:
        """Read an ``error`` frame's body (see :func:`nbaccel.launch.worker.process.describe_error`)."""
        return cls(time=float(body.get("time", time.time())), exc_type=body.get("exc_type", ""),
                   message=body.get("message", ""), traceback=body.get("traceback", ""),
                   exception=body.get("exception"), exception_note=body.get("exception_note", ""))


_SILENT = ("the process exited without reporting an exception (os._exit, a crash in native code, or an OOM kill)")


def rank_failure(rank: int, pid: int, ended: ProcessExit | None, error: RankError | None) -> WorkerFailure:
    """The one place a rank's :class:`WorkerFailure` is made: what it reported, else how its process ended.

    Example:
        >>> rank_failure(1, 99, ProcessExit(signal=9), None).summary
        'rank 1 (pid 99) was killed by signal SIGKILL'
    """
    ended = ended or ProcessExit()
    if error is not None:
        return WorkerFailure(rank=rank, pid=pid, exitcode=ended.exitcode, signal=ended.signal, **vars(error))
    if ended.signal is not None:
        message = ""
    elif ended.exitcode == 0:
        message = "exited with code 0 before returning (sys.exit(0) or os._exit(0) outside the function's return)"
    else:
        message = _SILENT
    return WorkerFailure(rank=rank, pid=pid, time=time.time(), exitcode=ended.exitcode, signal=ended.signal,
                         message=message)


class RemoteTraceback(Exception):
    """Carries a worker's traceback text so it prints as the cause of the re-raised error."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n" + self.text.rstrip()


# What a collective or the rendezvous store raises in a rank whose peer is gone (gloo, NCCL, the
# TCPStore): a consequence of another rank's failure, never its cause while that cause is known.
_PEER_LOSS = ("connection reset by peer", "connection closed by peer", "broken pipe", "connection refused",
              "remote process exited", "communicator was aborted", "nccl error", "ncclremoteerror",
              "failed to recv", "recv failed", "socket timeout", "timed out waiting for", "distbackenderror")


def is_peer_loss(failure: WorkerFailure) -> bool:
    """Whether ``failure`` is a rank's collective or store call failing because a peer went away."""
    if not failure.exc_type:
        return False
    text = f"{failure.exc_type} {failure.message}".lower()
    return any(sign in text for sign in _PEER_LOSS)


def _sorted(failures: Sequence[WorkerFailure]) -> list[WorkerFailure]:
    # The root cause is the earliest failure that is not a consequence: a rank killed by a signal or
    # exiting is noticed here only after its peers' collectives have already failed on it. A reported
    # exception beats a bare exit at the same moment: the exit is often the echo.
    causes = [f for f in failures if not is_peer_loss(f)]
    consequence = {id(f): bool(causes) and is_peer_loss(f) for f in failures}
    return sorted(failures, key=lambda f: (consequence[id(f)], f.time, 0 if f.exc_type else 1, f.rank))


def _what(failure: WorkerFailure) -> tuple[str, str]:
    """What a failure was, whichever rank it happened on: its summary without rank and pid, and its traceback."""
    return failure.summary.split(") ", 1)[-1], failure.traceback


def format_report(failures: Sequence[WorkerFailure], stopped: Sequence[int] = (), world_size: int | None = None) -> str:
    """A readable report: the root cause first, then the other ranks, identical errors grouped.

    When other ranks failed exactly as the root cause did, the first line says so ("all 2 ranks
    raised ...", or "ranks 0, 2 raised ..."): no one rank is the cause of an error every rank hit.

    Example:
        >>> same = [WorkerFailure(rank=r, pid=10 + r, time=1.0 + r, exc_type="ValueError", message="bad")
        ...         for r in (0, 1)]
        >>> format_report(same, world_size=2)
        'root cause: all 2 ranks raised ValueError: bad'
    """
    ordered = _sorted(failures)
    root = ordered[0]
    alike = [f for f in ordered if _what(f) == _what(root)]
    if len(alike) == 1:
        lines = [f"root cause: {root.summary}"]
    else:
        who = f"all {len(alike)} ranks" if len(alike) == world_size else _ranks(sorted(f.rank for f in alike))
        what = _what(root)[0]
        lines = [f"root cause: {who} {'were' + what[3:] if what.startswith('was ') else what}"]
    groups: dict[tuple[str, str], list[int]] = {}
    for failure in ordered:
        if failure not in alike:
            groups.setdefault(_what(failure), []).append(failure.rank)
    for (summary, _), ranks in groups.items():
        lines.append(f"also failed: {_ranks(ranks)}: {summary}")
    if stopped:
        lines.append(f"stopped by nbaccel after the failure: {_ranks(sorted(stopped))}")
    return "\n".join(lines)


def _ranks(ranks: Sequence[int]) -> str:
    """``rank 2`` or ``ranks 1, 2``."""
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}"


def raise_failures(failures: Sequence[WorkerFailure], world_size: int,
                   stopped: Sequence[int] = ()) -> NoReturn:
    """Raise the root cause in the caller, as a member of the :class:`WorkerFailedError` family.

    Raises:
        WorkerFailedError: always a member of this family, with every rank's failure on ``failures``
            (root cause first): the root-cause worker's own exception type joined with it when that
            exception could be rebuilt here (why not is said in the message otherwise);
            :class:`ProcessExitedError` when the root cause exited or was killed without reporting an
            exception; a plain ``WorkerFailedError`` otherwise. A rank's ``SystemExit``,
            ``KeyboardInterrupt`` or other ``BaseException`` is reported this way too, never raised as
            itself: it would exit the caller, or look like the caller's own interrupt.
    """
    ordered = tuple(_sorted(failures))
    root = ordered[0]
    report = format_report(ordered, stopped, world_size)
    note = root.exception_note and _unrebuilt(root, root.exception_note)
    if root.exception is not None:
        try:
            exc = unpack_exception(root.exception)
        except Exception as error:  # noqa: BLE001 - said in the generic error below
            exc, note = None, _unrebuilt(root, f"{type(error).__name__}: {error}")
        if isinstance(exc, Exception):
            exc = in_family(exc, ordered)
            if hasattr(exc, "add_note"):
                exc.add_note(f"[nbaccel] {report}\n[nbaccel] world size {world_size}; the traceback "
                             f"above the line is rank {root.rank}'s, in the worker.")
            raise exc.with_traceback(None) from RemoteTraceback(root.traceback)
        if exc is not None:
            note = _not_raised_here(exc, root.rank)
    if not root.exc_type:
        raise ProcessExitedError(f"{report}\n(world size {world_size})", failures=ordered)
    said = f"\n{note}" if note else ""
    raise WorkerFailedError(f"{report}{said}\n\n{root.traceback}", failures=ordered) from None


def _unrebuilt(root: WorkerFailure, why: str) -> str:
    return (f"rank {root.rank}'s {root.exc_type} could not be rebuilt here ({why}), "
            "so it is raised as a WorkerFailedError.")


def _not_raised_here(exc: BaseException, rank: int) -> str:
    """Why a rank's ``SystemExit`` / ``KeyboardInterrupt`` / other ``BaseException`` is not raised as itself."""
    if isinstance(exc, SystemExit):
        return (f"The function called sys.exit({exc.code!r}) in rank {rank}: that ends the rank only, so it is "
                "reported here as a WorkerFailedError instead of exiting the caller. Fix: return from the function "
                "or raise an exception (sys.exit(0) counts as returning None).")
    if isinstance(exc, KeyboardInterrupt):
        return (f"Rank {rank} raised KeyboardInterrupt itself (the caller was not interrupted), so it is reported "
                "here as a WorkerFailedError.")
    return (f"Rank {rank}'s {type(exc).__name__} is not an Exception: raised here it could end the caller, so "
            "it is reported as a WorkerFailedError.")
