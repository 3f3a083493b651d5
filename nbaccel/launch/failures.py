"""Worker failures as data, and how they are raised in the caller, root cause first.

The earliest failure is the root cause. Every launcher (one machine or several, processes or
XLA replicas) reports failures as :class:`WorkerFailure` records and raises them here, so a
failed launch has one shape everywhere: an exception of the
:class:`~nbaccel.errors.WorkerFailedError` family carrying every rank's failure on ``failures``,
root cause first. A worker that raised an ``Exception`` is re-raised as its own type joined with
``WorkerFailedError`` (so ``except KeyError`` still works), with its message; the remote
traceback is chained as ``__cause__``. Failures that cannot be re-raised that way (``os._exit``,
a signal, an exception that does not unpickle) raise :class:`~nbaccel.errors.ProcessExitedError`
/ :class:`~nbaccel.errors.WorkerFailedError`.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

from nbaccel.errors import ProcessExitedError, WorkerFailedError, child_failed_bases
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


def _family_type(kind: type[BaseException]) -> type[BaseException] | None:
    """``kind`` joined with :class:`WorkerFailedError` (cached), or ``None`` when it cannot or must not be."""
    if issubclass(kind, WorkerFailedError):
        return kind
    if not issubclass(kind, Exception):  # KeyboardInterrupt, SystemExit: never caught by `except Exception`
        return None
    joined = _JOINED.get(kind)
    if joined is None:
        try:
            joined = type(kind.__name__, (kind, WorkerFailedError, *child_failed_bases()), {
                "__module__": kind.__module__, "__qualname__": kind.__qualname__,
                "__reduce__": _reduce_joined, "__doc__": kind.__doc__})
        except TypeError:  # a final or layout-incompatible exception type
            return None
        _JOINED[kind] = joined
    return joined


_JOINED: dict[type[BaseException], type[BaseException]] = {}


def _reduce_joined(self: BaseException) -> tuple:
    own = type(self).__mro__[1]
    return (_rebuild_joined, (own, self.args, dict(self.__dict__)))


def _rebuild_joined(own: type[BaseException], args: tuple, state: dict) -> BaseException:
    joined = _family_type(own) or own
    exc = joined.__new__(joined, *args)
    # A built-in type's __init__ only stores its arguments (UnicodeError's fields, say); a user's own
    # __init__ may transform them, and its result is already in args and state: not called again.
    init_owner = next(k for k in own.__mro__ if "__init__" in k.__dict__)
    (own.__init__ if init_owner.__module__ == "builtins" else BaseException.__init__)(exc, *args)
    exc.__dict__.update(state)
    return exc


def _in_family(exc: BaseException, failures: tuple[WorkerFailure, ...]) -> BaseException:
    """``exc`` as an instance of its own type and of :class:`WorkerFailedError`, carrying ``failures``."""
    joined = _family_type(type(exc))
    if joined is not None and joined is not type(exc):
        try:
            rebuilt = _rebuild_joined(type(exc), exc.args, dict(exc.__dict__))
            for name in ("errno", "strerror", "filename", "filename2"):  # OSError's own fields
                if hasattr(exc, name) and getattr(rebuilt, name, None) != getattr(exc, name):
                    setattr(rebuilt, name, getattr(exc, name))
            exc = rebuilt
        except Exception:  # noqa: BLE001 - an odd constructor: keep the exception as it came
            pass
    try:
        exc.failures = failures  # type: ignore[attr-defined]
        if not isinstance(exc, WorkerFailedError):
            exc.launch_failures = failures  # type: ignore[attr-defined]
    except AttributeError:  # an exception type without a __dict__
        pass
    return exc


def raise_failures(failures: Sequence[WorkerFailure], world_size: int,
                   stopped: Sequence[int] = ()) -> NoReturn:
    """Raise the root cause in the caller, as a member of the :class:`WorkerFailedError` family.

    Raises:
        WorkerFailedError: always a member of this family, with every rank's failure on ``failures``
            (root cause first): the root-cause worker's own exception type joined with it when that
            exception could be rebuilt here; :class:`ProcessExitedError` when the root cause exited
            or was killed without reporting an exception; a plain ``WorkerFailedError`` otherwise.
        BaseException: a root cause that is not an ``Exception`` (``KeyboardInterrupt``,
            ``SystemExit``) is raised as it is, with ``failures`` attached.
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
            exc = _in_family(exc, ordered)
            if hasattr(exc, "add_note"):
                exc.add_note(f"[nbaccel] {report}\n[nbaccel] world size {world_size}; the traceback "
                             f"above the line is rank {root.rank}'s, in the worker.")
            raise exc.with_traceback(None) from RemoteTraceback(root.traceback)
    if not root.exc_type:
        raise ProcessExitedError(f"{report}\n(world size {world_size})", failures=ordered)
    raise WorkerFailedError(f"{report}\n\n{root.traceback}", failures=ordered) from None
