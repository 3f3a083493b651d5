"""The Ray launcher: a launch's ranks as Ray actors in one placement group, on a Ray cluster.

The request's plan comes from the cluster (:func:`plan_ray_launch`: it connects first, as
``ray_address`` says, and refuses what the whole cluster could never hold); this launcher starts
the ranks (:class:`~nbaccel.launch.ray.ranks.RayRanks`), runs the function once under the local
launch's supervisor, and then kills every actor and removes the placement group, whatever happened.
"""

from __future__ import annotations

from typing import Any

from nbaccel.config import LaunchConfig
from nbaccel.errors import ConfigError
from nbaccel.launch.backend import Backend
from nbaccel.launch.preflight import DeviceKind, LaunchPlan, settings_for
from nbaccel.launch.ray.cluster import check_room, cluster_totals, connect
from nbaccel.launch.ray.pool import RayPoolRanks
from nbaccel.launch.ray.ranks import RayRanks
from nbaccel.launch.request import LaunchRequest
from nbaccel.launch.supervised_run import Lifetime, SupervisedRun

__all__ = ["ACTOR_START_TIMEOUT", "BACKEND", "LAUNCHER", "RayLauncher", "plan_ray_launch"]

ACTOR_START_TIMEOUT = 300.0
"""Seconds the rank actors may take to be placed and started, whatever the launch's ``timeout``."""


_MAX_AUTO_CPU_RANKS = 4


def plan_ray_launch(config: LaunchConfig) -> LaunchPlan:
    """Decide device kind and rank count for ``config`` on its Ray cluster (connecting to it).

    GPU ranks when the cluster has GPUs and ``use_cpu`` is not set; ``num_processes=None`` takes
    every GPU of the cluster, or on a CPU-only cluster one rank per CPU up to 4 (and says so).
    Functions travel by value, as under spawn. Where we differ from a local launch: fp8 support
    is checked by each rank's ``Accelerator``, since the cluster's GPUs are not visible here.

    Raises:
        MissingDependencyError: Ray is not installed.
        ConfigError: the cluster cannot hold the ranks, or GPUs were asked of a cluster without any.
        LaunchError: Ray could not connect.
    """
    notes = [connect(config.ray_address)]
    totals = cluster_totals()
    kind: DeviceKind
    if config.use_cpu or config.distributed_type == "MULTI_CPU":
        kind = "cpu"
    elif totals["GPU"] > 0:
        kind = "cuda"
    elif config.distributed_type == "MULTI_GPU":
        raise ConfigError("distributed_type='MULTI_GPU' but the Ray cluster has no GPUs. Fix: set use_cpu=True "
                          "for CPU ranks, or add GPU nodes to the cluster.", key="distributed_type",
                          value="MULTI_GPU", valid=("MULTI_CPU", "NO"))
    else:
        kind = "cpu"
    n = config.num_processes
    if n is None:
        if kind == "cuda":
            n = int(totals["GPU"])
        else:
            n = max(1, min(int(totals["CPU"]), _MAX_AUTO_CPU_RANKS))
            notes.append(f"nbaccel: the Ray cluster has no GPU ranks to give; using {n} CPU ranks (one per CPU, "
                         f"at most {_MAX_AUTO_CPU_RANKS}). Pass num_processes= to choose.")
    check_room(n, use_gpu=kind == "cuda")
    return LaunchPlan(num_processes=n, device_kind=kind, start_method="spawn", start_reason=None,
                      settings=settings_for(config, kind, n), visible_gpus=None, threads=1,
                      note="\n".join(note for note in notes if note) or None)


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
BACKEND = Backend(LAUNCHER, plan=plan_ray_launch, start_pool=RayPoolRanks.start)
