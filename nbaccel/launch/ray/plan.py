"""Planning a launch on a Ray cluster: its devices and rank count come from the cluster, not this machine.

The local preflight (:mod:`nbaccel.launch.preflight`) counts this machine's GPUs and memory; a
Ray launch asks the cluster instead (connecting first, as ``ray_address`` says), and refuses a
request the whole cluster could never hold before anything is reserved.
"""

from __future__ import annotations

from nbaccel.config import LaunchConfig
from nbaccel.errors import ConfigError
from nbaccel.launch.preflight import LaunchPlan, settings_for
from nbaccel.launch.ray.cluster import check_room, cluster_totals, connect

__all__ = ["plan_ray_launch"]

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
