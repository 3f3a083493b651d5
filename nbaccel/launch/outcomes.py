"""What a supervised run learned, apart from the processes: each rank's outcome, and the run's result.

As torch elastic's ``RunProcsResult``: handles say how to reach ranks; these say what happened.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from nbaccel.launch.events import RankState
from nbaccel.launch.failures import ProcessExit, RankError, WorkerFailure, raise_failures

__all__ = ["RankOutcome", "RunResult"]


@dataclass
class RankOutcome:
    """What the supervisor learned of one rank in one run.

    Attributes:
        state: where the rank is, as the observer hears it.
        result: the pickled value it returned (``b""``: it finished, its value was not asked for).
        error: what it reported raising.
        exit: how its run ended (``None`` while it runs).
        started_at: when it said ``started`` (its own clock, ``time.time()``).
        result_at: when its result arrived (``time.monotonic()``).
    """

    state: RankState = "starting"
    result: bytes | None = None
    error: RankError | None = None
    exit: ProcessExit | None = None
    started_at: float | None = None
    result_at: float | None = None

    @property
    def ended(self) -> bool:
        """Whether the rank's run is over."""
        return self.exit is not None

    @property
    def replied(self) -> bool:
        """Whether the rank reported its result or its error."""
        return self.result is not None or self.error is not None


@dataclass(frozen=True)
class RunResult:
    """How a supervised run ended: each rank's returned value, or every failure, root cause among them.

    Attributes:
        values: ``{rank: value}`` of the ranks that sent one.
        failures: every failed rank's record (empty when the run succeeded).
        stopped: ranks nbaccel stopped after the first failure that had not failed on their own (those are in
            ``failures`` only).
        world_size: how many ranks ran.
    """

    values: dict[int, Any] = field(default_factory=dict)
    failures: Sequence[WorkerFailure] = ()
    stopped: Sequence[int] = ()
    world_size: int = 0

    def get(self) -> dict[int, Any]:
        """The values; raises the root cause when a rank failed.

        Raises:
            WorkerFailedError: see :func:`~nbaccel.launch.failures.raise_failures`.
        """
        if self.failures:
            raise_failures(self.failures, self.world_size, self.stopped)
        return self.values
