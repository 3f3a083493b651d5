"""The observer base class: how a status panel follows a launch without slowing it down.

Like Accelerate's ``ModelHook``, :class:`LaunchObserver` has a no-op method for every event; an
object that does not subclass it is wrapped once by :func:`as_observer`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

__all__ = ["LaunchObserver", "RankState", "as_observer"]

RankState = Literal["starting", "running", "finished", "failed", "stopped"]
Stream = Literal["stdout", "stderr"]


class LaunchObserver:
    """Receives a launch's events, on the caller's thread, between reads of worker output.

    Implementations must return quickly; the supervisor calls them inline.

    Attributes:
        shows_progress: the observer draws progress bars itself: the relay then writes only each
            bar's final line to the caller's streams, not every redraw.

    Example:
        >>> class Lines(LaunchObserver):
        ...     def on_output(self, rank, stream, line): print(f"{rank}: {line}")
        >>> Lines().on_output(0, "stdout", "hi"); Lines().on_end(True)
        0: hi
    """

    shows_progress: bool = False

    def on_launch(self, ranks: Sequence[int], start_method: str) -> None:
        """The workers are about to start."""

    def on_state(self, rank: int, state: RankState) -> None:
        """Rank ``rank`` moved to ``state``."""

    def on_output(self, rank: int, stream: Stream, line: str) -> None:
        """Rank ``rank`` printed ``line`` (without its newline)."""

    def on_progress(self, rank: int, stream: Stream, text: str) -> None:
        """Rank ``rank`` redrew a line with ``\\r`` (a progress bar); ``text`` is how it reads now."""

    def on_log(self, rank: int, record: dict[str, Any]) -> None:
        """Rank ``rank`` logged ``record`` with ``accelerator.log``."""

    def on_end(self, ok: bool) -> None:
        """Every worker is gone; ``ok`` is ``True`` when all of them finished."""


class _Forwarding(LaunchObserver):
    """An object with some of the observer's methods, seen as a :class:`LaunchObserver`."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.shows_progress = bool(getattr(inner, "shows_progress", False))
        for name in ("on_launch", "on_state", "on_output", "on_progress", "on_log", "on_end"):
            method = getattr(inner, name, None)  # the one place an observer's methods are looked up
            if method is not None:
                setattr(self, name, method)


def as_observer(observer: Any) -> LaunchObserver | None:
    """``observer`` as a :class:`LaunchObserver` (an object with only some of its methods is wrapped).

    Example:
        >>> class Ends:
        ...     def on_end(self, ok): print("ended", ok)
        >>> seen = as_observer(Ends()); seen.on_log(0, {}); seen.on_end(True)
        ended True
    """
    if observer is None or isinstance(observer, LaunchObserver):
        return observer
    return _Forwarding(observer)
