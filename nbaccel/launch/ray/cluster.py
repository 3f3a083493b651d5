"""What nbaccel asks of a Ray cluster: a connection, room for N ranks, and where each rank landed.

Ray schedules, discovers nodes and detects failures; this module states the request in Ray's
terms (a placement-group bundle per rank, a GPU each unless CPU ranks) and reads the answer back
as torchrun's layout (ranks grouped by node, local ranks ordered by GPU, so ``cuda:LOCAL_RANK`` is
the rank's own). Ray is imported only here and in the actor (``pip install 'nbaccel[ray]'``).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from nbaccel.errors import ConfigError, LaunchError, MissingDependencyError

__all__ = ["Placement", "RankLayout", "RankSite", "bundle_for", "check_room", "cluster_totals", "connect",
           "layout_ranks",
           "place_bundles", "require_ray"]

_INSTALL = "pip install 'nbaccel[ray]'"
_QUIET_WAIT = 10.0  # seconds of waiting for the cluster's resources before saying so


def require_ray() -> ModuleType:
    """The ``ray`` module.

    Raises:
        MissingDependencyError: Ray is not installed in this environment.
    """
    try:
        import ray
    except ImportError:
        raise MissingDependencyError(
            f"backend='ray' runs the workers on a Ray cluster, but Ray is not installed here. Fix: {_INSTALL} "
            "(or pip install 'ray[default]'), then restart the kernel; or use backend='local' for this machine's "
            "processes.", package="ray", needed_for="backend='ray'", install=_INSTALL) from None
    return ray


def connect(address: str | None) -> str:
    """Make sure this process is connected to a Ray cluster; returns a one-line note, or ``""``.

    ``None`` keeps the connection this process has (the user's own ``ray.init``), else does what
    ``ray.init()`` does (``RAY_ADDRESS``, else a new local instance, which stays up for later
    launches). ``"auto"``, ``"host:port"`` and ``"ray://host:port"`` connect as ``ray.init`` does.

    Raises:
        MissingDependencyError: Ray is not installed.
        ConfigError: this process is connected to another cluster than ``address``.
        LaunchError: Ray could not connect to ``address`` or start a local instance.
    """
    ray = require_ray()
    if ray.is_initialized():
        current = _current_address(ray)
        if address not in (None, "auto") and current and not _same_address(address, current):
            raise ConfigError(
                f"this process is already connected to the Ray cluster at {current}, but ray_address={address!r} "
                "asks for another one; Ray holds one connection per process. Fix: drop ray_address to use the "
                "current cluster, or call ray.shutdown() first.", key="ray_address", value=address,
                valid=[None, current])
        return ""
    started = time.monotonic()
    try:
        context = ray.init(address=address, log_to_driver=False, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise LaunchError(f"could not connect to the Ray cluster at {address!r}: {exc}. Fix: check the address "
                          "(`ray status` on the head node prints it), or pass ray_address=None to start a local "
                          "instance.") from None
    where = getattr(context, "address_info", {}).get("address", "")
    if address is None and not os.environ.get("RAY_ADDRESS"):
        return (f"nbaccel: started a local Ray instance in {time.monotonic() - started:.1f}s ({where}); it stays up "
                "for later launches (ray.shutdown() stops it).")
    return f"nbaccel: connected to the Ray cluster at {where or address}."


def _current_address(ray: ModuleType) -> str:
    try:
        return str(ray.get_runtime_context().gcs_address or "")
    except Exception:  # noqa: BLE001 - Ray Client connections have no GCS address here
        return ""


def _same_address(wanted: str, current: str) -> bool:
    return wanted.removeprefix("ray://").split(":")[0] in (current.split(":")[0], "localhost", "127.0.0.1") and (
        wanted.rsplit(":", 1)[-1] == current.rsplit(":", 1)[-1] or wanted.startswith("ray://"))


def cluster_totals() -> dict[str, float]:
    """The cluster's total ``CPU`` and ``GPU`` (alive nodes), as Ray reports them."""
    ray = require_ray()
    resources = ray.cluster_resources()
    return {"CPU": float(resources.get("CPU", 0)), "GPU": float(resources.get("GPU", 0))}


def bundle_for(use_gpu: bool) -> dict[str, float]:
    """One rank's share of the cluster: a CPU, and a GPU unless the ranks run on CPU."""
    return {"CPU": 1.0, "GPU": 1.0} if use_gpu else {"CPU": 1.0}


@dataclass
class Placement:
    """A placement group holding one bundle per rank; :meth:`remove` gives the resources back."""

    group: Any
    bundles: int

    def strategy_for(self, index: int) -> Any:
        """The scheduling strategy that puts an actor into bundle ``index``."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=index,
                                                placement_group_capture_child_tasks=True)

    def remove(self) -> None:
        """Remove the placement group (safe to call twice)."""
        if self.group is None:
            return
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self.group)
        except Exception:  # noqa: BLE001 - the cluster connection is gone: it went with it
            pass
        self.group = None


def check_room(n: int, use_gpu: bool) -> None:
    """Refuse ``n`` ranks that the whole cluster could never hold, before anything is reserved.

    Raises:
        ConfigError: the cluster has fewer CPUs or GPUs in all than ``n`` ranks need.
    """
    bundle = bundle_for(use_gpu)
    totals = cluster_totals()
    for resource, per_rank in bundle.items():
        if totals[resource] < n * per_rank:
            fit = int(totals[resource] // per_rank)
            fix = f"pass num_processes<={fit}" if fit else "add nodes with GPUs to the cluster"
            if resource == "GPU":
                fix += ", or use_cpu=True for CPU ranks"
            raise ConfigError(f"{n} ranks need {n * per_rank:g} {resource}s, but the Ray cluster has "
                              f"{totals[resource]:g} in all. Fix: {fix}.", key="num_processes", value=n,
                              valid=f"1..{fit}")


def place_bundles(n: int, use_gpu: bool, strategy: str, wait: float) -> Placement:
    """Reserve ``n`` rank bundles on the cluster with ``strategy``; waits up to ``wait`` seconds.

    Raises:
        ConfigError: the whole cluster has fewer CPUs or GPUs than ``n`` ranks need (:func:`check_room`).
        LaunchError: the cluster has them, but they did not come free within ``wait`` seconds
            (other jobs hold them, or ``strategy`` cannot be met); nothing is left reserved.
    """
    require_ray()
    from ray.util.placement_group import placement_group

    check_room(n, use_gpu)
    bundle = bundle_for(use_gpu)
    group = placement_group([dict(bundle) for _ in range(n)], strategy=strategy)
    placement = Placement(group=group, bundles=n)
    try:
        ready = group.wait(timeout_seconds=min(wait, _QUIET_WAIT))
        if not ready and wait > _QUIET_WAIT:
            free = require_ray().available_resources()
            print(f"nbaccel: waiting up to {wait - _QUIET_WAIT:g}s more for the Ray cluster to free {n} x {bundle} "
                  f"(free now: {free.get('CPU', 0):g} CPUs, {free.get('GPU', 0):g} GPUs)", file=sys.stderr, flush=True)
            ready = group.wait(timeout_seconds=wait - _QUIET_WAIT)
    except BaseException:
        placement.remove()
        raise
    if not ready:
        placement.remove()
        free = require_ray().available_resources()
        raise LaunchError(f"the Ray cluster could not place {n} ranks of {bundle} with strategy {strategy!r} within "
                          f"{wait:g}s (free now: {free.get('CPU', 0):g} CPUs, {free.get('GPU', 0):g} GPUs). Fix: "
                          "wait for other jobs to finish, use fewer ranks, or a looser ray_placement_strategy "
                          "('PACK' or 'SPREAD').")
    return placement


@dataclass(frozen=True)
class RankSite:
    """Where one actor landed, as it reports it (``RankActor.where``)."""

    bundle: int
    node_id: str
    ip: str
    pid: int
    gpu_ids: tuple[str, ...]
    node_cpus: float


@dataclass(frozen=True)
class RankLayout:
    """One actor's place in the job (torchrun's variables) and what it sees."""

    bundle: int
    rank: int
    local_rank: int
    local_world_size: int
    node_rank: int
    visible_gpus: str | None
    threads: int


def layout_ranks(sites: Sequence[RankSite]) -> list[RankLayout]:
    """Number the ranks: nodes in the order of their first bundle, local ranks by GPU (else bundle).

    Every actor on a node sees all the GPUs the job holds there (as Ray Train arranges it), so
    ``LOCAL_RANK`` indexes its own GPU and CUDA IPC between local ranks works.

    Example:
        >>> sites = [RankSite(0, "b", "10.0.0.2", 1, (), 2), RankSite(1, "a", "10.0.0.1", 2, (), 2),
        ...          RankSite(2, "b", "10.0.0.2", 3, (), 2)]
        >>> [(l.bundle, l.rank, l.node_rank, l.local_rank) for l in layout_ranks(sites)]
        [(0, 0, 0, 0), (2, 1, 0, 1), (1, 2, 1, 0)]
    """
    nodes: dict[str, list[RankSite]] = {}
    for site in sorted(sites, key=lambda s: s.bundle):
        nodes.setdefault(site.node_id, []).append(site)
    layouts: list[RankLayout] = []
    rank = 0
    for node_rank, members in enumerate(nodes.values()):
        held = sorted({g for s in members for g in s.gpu_ids}, key=_gpu_order)
        ordered = sorted(members, key=lambda s: (_gpu_order(s.gpu_ids[0]) if s.gpu_ids else -1, s.bundle))
        threads = max(1, int(members[0].node_cpus) // len(members))
        for local_rank, site in enumerate(ordered):
            layouts.append(RankLayout(bundle=site.bundle, rank=rank, local_rank=local_rank,
                                      local_world_size=len(members), node_rank=node_rank,
                                      visible_gpus=",".join(held) if held else None, threads=threads))
            rank += 1
    return layouts


def _gpu_order(gpu: str) -> tuple[int, str]:
    return (int(gpu), "") if gpu.isdigit() else (1 << 30, gpu)
