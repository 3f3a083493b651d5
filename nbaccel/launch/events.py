"""The observer protocol: how a status panel follows a launch without slowing it down."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol

__all__ = ["LaunchObserver", "RankState"]

RankState = Literal["starting", "running", "finished", "failed", "stopped"]


class LaunchObserver(Protocol):
    """Receives a launch's events, on the caller's thread, between reads of worker output.

    Implementations must return quickly; the supervisor calls them inline.
    """

    def on_launch(self, ranks: Sequence[int], start_method: str) -> None:
        """The workers are about to start."""

    def on_state(self, rank: int, state: RankState) -> None:
        """Rank ``rank`` moved to ``state``."""

    def on_output(self, rank: int, stream: Literal["stdout", "stderr"], line: str) -> None:
        """Rank ``rank`` printed ``line`` (without its newline)."""

    # An observer with ``shows_progress = True`` draws the bars itself: the relay then writes only each
    # bar's final line to the caller's streams, not every redraw.

    def on_progress(self, rank: int, stream: Literal["stdout", "stderr"], text: str) -> None:
        """Rank ``rank`` redrew a line with ``\\r`` (a progress bar); ``text`` is how it reads now (optional)."""

    def on_log(self, rank: int, record: dict[str, Any]) -> None:
        """Rank ``rank`` logged ``record`` with ``accelerator.log`` (optional: called only when defined)."""

    def on_end(self, ok: bool) -> None:
        """Every worker is gone; ``ok`` is ``True`` when all of them finished."""
