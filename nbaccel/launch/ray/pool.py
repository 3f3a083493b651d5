"""A warm pool on Ray: the ranks' actors, their process group and namespaces kept between runs.

:class:`~nbaccel.launch.pool.worker_pool.WorkerPool` with ``backend="ray"`` keeps a
:class:`~nbaccel.launch.ray.ranks.RayRanks` instead of local processes: the actors join the
process group once when the pool starts, and each run is a call on live actors, supervised as a
launch is. The rules are a local pool's: a rank that raises leaves the pool alive; an interrupt,
a timeout or a failure interrupts the other ranks (``KeyboardInterrupt`` in their function), and
a rank that does not stop within ``grace`` is killed, which ends the pool (its process group is
broken). ``close()`` kills the actors and removes the placement group.

Where a Ray pool differs from a local one, because Ray runs actor methods in threads and never
interrupts them: the ``KeyboardInterrupt`` reaches a rank's Python code between two bytecodes,
not a native call in progress. A training loop stops at its next Python step; a rank inside one
long native call (``time.sleep(600)``, a collective waiting for a rank that left) is killed after
``grace``, and the pool with it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from nbaccel.launch.events import LaunchObserver
from nbaccel.launch.local.launcher import request_relay
from nbaccel.launch.ray.cluster import require_ray
from nbaccel.launch.ray.ranks import RayRanks
from nbaccel.launch.request import LaunchRequest
from nbaccel.launch.supervisor import SupervisorPolicy

__all__ = ["RayPoolRanks"]


class RayPoolRanks:
    """The Ray side of a :class:`~nbaccel.launch.pool.worker_pool.WorkerPool` (see the module docstring)."""

    def __init__(self, request: LaunchRequest, start_timeout: float) -> None:
        self._request = request
        self.ranks = RayRanks.start(request, start_timeout=start_timeout, join_group=True)

    def dead(self) -> str:
        """Why the pool cannot run (a rank's actor is gone), or ``""``."""
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

    def run(self, function: Callable[..., Any], args: Any, kwargs: Mapping[str, Any], output_ranks: Any,
            observer: LaunchObserver | None, *, grace: float, timeout: float | None,
            return_all: bool = True) -> dict[int, Any]:
        """Run ``function`` on every rank; every rank's value (rank 0's alone unless ``return_all``), moved to CPU.

        Raises:
            KeyboardInterrupt: the caller was interrupted; its message says whether the pool lives.
            BaseException: what a launch raises (the root-cause failure, a timeout).
        """
        request = dataclasses.replace(self._request, output_ranks=output_ranks, observer=observer)
        policy = SupervisorPolicy(timeout=timeout, hang_timeout=None, grace=grace)
        try:
            return self.ranks.run(function, args, kwargs, relay=request_relay(request), observer=observer,
                                  policy=policy, return_all=return_all, cpu_results=True)
        except KeyboardInterrupt:
            lost = self.ranks.lost
            state = f"; {lost}, so the pool is dead: restart it" if lost else \
                "; the run was cancelled in every rank and the pool is alive"
            raise KeyboardInterrupt(f"interrupted{state}") from None

    def shutdown(self) -> None:
        """Kill the actors and remove the placement group."""
        self.ranks.shutdown()
