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

from nbaccel.launch.ray.ranks import RayRanks
from nbaccel.launch.request import LaunchRequest
from nbaccel.launch.supervised_run import Lifetime, SupervisedRun

__all__ = ["ACTOR_START_TIMEOUT", "LAUNCHER", "RayLauncher"]

ACTOR_START_TIMEOUT = 300.0
"""Seconds the rank actors may take to be placed and started, whatever the launch's ``timeout``."""


class RayLauncher:
    """Runs a request's ranks as Ray actors (see the module docstring)."""

    name = "ray"

    def launch(self, request: LaunchRequest) -> dict[int, Any]:
        """Start the ranks on the cluster, run the function once, and leave nothing behind."""
        with SupervisedRun(request, Lifetime("ray")) as run:
            # The launch's timeout bounds the run, as for a local launch; placing and starting the actors
            # has its own budget (a busy cluster, or a loaded machine, takes far longer than a short run).
            ranks = RayRanks.start(request, start_timeout=ACTOR_START_TIMEOUT)
            try:
                return ranks.run(request.function, request.args, request.kwargs, run=run,
                                 return_all=request.return_all)
            finally:
                ranks.shutdown()


LAUNCHER = RayLauncher()
