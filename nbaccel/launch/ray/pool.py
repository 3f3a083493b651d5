"""A warm pool on Ray: the ranks' actors, their process group and namespaces kept between runs.

:class:`~nbaccel.launch.pool.worker_pool.WorkerPool` with ``backend="ray"`` keeps a
:class:`~nbaccel.launch.ray.ranks.RayRanks` instead of local processes, with a local pool's rules.
Where it differs, because Ray runs actor methods in threads and never interrupts them: the
``KeyboardInterrupt`` reaches a rank's Python code between two bytecodes, not a native call in
progress; a rank inside one long native call (``time.sleep(600)``, a collective waiting for a rank
that left) is killed after ``grace``, and the pool with it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from nbaccel.launch.ray.cluster import require_ray
from nbaccel.launch.ray.ranks import RayRanks
from nbaccel.launch.request import LaunchRequest
from nbaccel.launch.supervised_run import SupervisedRun

__all__ = ["RayPoolRanks"]


class RayPoolRanks:
    """The Ray side of a :class:`~nbaccel.launch.pool.worker_pool.WorkerPool` (see the module docstring)."""

    def __init__(self, ranks: RayRanks) -> None:
        self.ranks = ranks

    @classmethod
    def start(cls, request: LaunchRequest, start_timeout: float) -> RayPoolRanks:
        """Start the rank actors; each joins the process group once, for the pool's life.

        Raises:
            MissingDependencyError: Ray is not installed.
            LaunchError: the actors did not start within ``start_timeout`` (nothing is left running).
        """
        return cls(RayRanks.start(request, start_timeout=start_timeout, join_group=True))

    def dead(self) -> str | None:
        """Why the pool cannot run (a rank's actor is gone), or ``None``."""
        if self.ranks.lost:
            return self.ranks.lost
        gone = self.ranks.lost_ranks()
        if gone:
            self.ranks.lost = f"the Ray actors of ranks {gone} are gone (their node left the cluster, or they died)"
        return self.ranks.lost

    def workers(self) -> list[tuple[int, int, bool, str, int | None]]:
        """``(rank, pid, alive, device, resident bytes)`` per rank, as the actors report them."""
        ray = require_ray()
        gone = set(self.ranks.lost_ranks())
        refs = {m.rank: m.actor.resident_bytes.remote() for m in self.ranks.members if m.rank not in gone}
        out = []
        for member in self.ranks.members:
            try:
                memory = ray.get(refs[member.rank], timeout=10.0) if member.rank in refs else None
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                memory = None
            out.append((member.rank, member.site.pid, member.rank not in gone, member.device, memory))
        return out

    @property
    def lost(self) -> str | None:
        """Why the ranks cannot run any more (an actor died or was killed), or ``None``."""
        return self.ranks.lost

    def run(self, function: Callable[..., Any], args: Any, kwargs: Mapping[str, Any], *, run: SupervisedRun,
            result_ranks: Collection[int] | None) -> dict[int, Any]:
        """Run ``function`` on every rank; ``{rank: value}`` of ``result_ranks`` (all when ``None``), moved to CPU.

        Raises:
            BaseException: what a launch raises (the root-cause failure, a timeout, the interrupt);
                :attr:`lost` then says whether the actors survived it.
        """
        results = self.ranks.run(function, args, kwargs, run=run,
                                 return_all=result_ranks is None or set(result_ranks) != {0}, cpu_results=True)
        return results if result_ranks is None else {r: v for r, v in results.items() if r in result_ranks}

    def shutdown(self) -> None:
        """Kill the actors and remove the placement group."""
        self.ranks.shutdown()
