"""The Ray launcher: a launch's ranks as Ray actors in one placement group, on a Ray cluster.

``notebook_launcher(fn, num_processes=8, backend="ray")`` and ``%%accel_launch --backend ray``
build a request whose plan came from the cluster (:mod:`nbaccel.launch.ray.plan`); this launcher
starts the ranks (:class:`~nbaccel.launch.ray.ranks.RayRanks`), runs the function once under the
local launch's supervisor, and ends the job: after success, a failure or an interrupt, every actor
is killed and the placement group removed. Ray does the placement and notices dead actors;
nbaccel never re-implements either.
"""

from __future__ import annotations

from typing import Any

from nbaccel.launch.base import Backend
from nbaccel.launch.ray.plan import plan_ray_launch
from nbaccel.launch.ray.pool import RayPoolRanks
from nbaccel.launch.ray.ranks import RayRanks
from nbaccel.launch.relay import request_relay
from nbaccel.launch.request import LaunchRequest
from nbaccel.launch.supervisor import SupervisorPolicy

__all__ = ["ACTOR_START_TIMEOUT", "BACKEND", "LAUNCHER", "RayLauncher"]

ACTOR_START_TIMEOUT = 300.0
"""Seconds the rank actors may take to be placed and started, whatever the launch's ``timeout``."""


class RayLauncher:
    """Runs a request's ranks as Ray actors (see the module docstring)."""

    name = "ray"

    def launch(self, request: LaunchRequest) -> dict[int, Any]:
        """Start the ranks on the cluster, run the function once, and leave nothing behind."""
        observer = request.observer
        n = request.num_processes
        ok = False
        if observer is not None:
            observer.on_launch(list(range(n)), "ray")
        try:
            # The launch's timeout bounds the run, as for a local launch; placing and starting the actors
            # has its own budget (a busy cluster, or a loaded machine, takes far longer than a short run).
            ranks = RayRanks.start(request, start_timeout=ACTOR_START_TIMEOUT)
            try:
                policy = SupervisorPolicy(timeout=request.config.timeout, hang_timeout=request.hang_timeout)
                results = ranks.run(request.function, request.args, request.kwargs, relay=request_relay(request),
                                    observer=observer, policy=policy, return_all=request.return_all)
            finally:
                ranks.shutdown()
            ok = True
            return results
        finally:
            if observer is not None:
                observer.on_end(ok)


LAUNCHER = RayLauncher()
BACKEND = Backend(LAUNCHER, plan=plan_ray_launch, start_pool=RayPoolRanks.start)
