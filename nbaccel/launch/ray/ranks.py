"""`RayRanks`: N rank actors in one placement group, started, run (once or many times), and ended.

:meth:`RayRanks.start` places one bundle per rank (PACK unless configured), starts a
:class:`~nbaccel.launch.ray.actor.RankActor` in each, numbers the ranks as torchrun would from
where they landed, and has rank 0's actor host the rendezvous store. Each run puts the payload
once and supervises one :class:`~nbaccel.launch.ray.handles.RayRankHandle` per rank, fed by a
:class:`~nbaccel.launch.ray.handles.RunPump`. :meth:`RayRanks.shutdown` kills every actor and
removes the placement group. The one-shot launcher starts, runs once and shuts down; a pool on
Ray keeps the ranks between runs.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nbaccel.environment import DistributedEnv, worker_environment
from nbaccel.errors import LaunchError
from nbaccel.launch.payload import dumps_payload
from nbaccel.launch.ray.actor import RankActor
from nbaccel.launch.ray.cluster import (
    Placement,
    RankLayout,
    RankSite,
    layout_ranks,
    place_bundles,
    require_ray,
)
from nbaccel.launch.ray.handles import RayRankHandle, RunPump
from nbaccel.launch.request import LaunchRequest
from nbaccel.launch.supervised_run import SupervisedRun

__all__ = ["RankMember", "RayRanks"]

_ACTOR_THREADS = 4  # run, drain, interrupt / stack dump, and one spare


@dataclass(frozen=True)
class RankMember:
    """One started rank: its actor, where it runs, and its place in the job."""

    rank: int
    actor: Any
    site: RankSite
    layout: RankLayout

    @property
    def device(self) -> str:
        """The rank's device, as the rank itself will name it."""
        return f"cuda:{self.layout.local_rank}" if self.site.gpu_ids else "cpu"


class RayRanks:
    """The actors of one Ray job; see the module docstring. Build with :meth:`start`."""

    def __init__(self, placement: Placement, members: list[RankMember], nodes: int) -> None:
        self.placement = placement
        self.members = members
        self.nodes = nodes
        self._runs = itertools.count(1)
        self._closed = False
        self.lost: str | None = None
        """Why some rank's actor is gone after a run (``None`` while every actor lives)."""

    # ------------------------------------------------------------------ starting
    @classmethod
    def start(cls, request: LaunchRequest, *, start_timeout: float = 300.0, join_group: bool = False) -> RayRanks:
        """Reserve the bundles, start one actor per rank, number them, and give each its environment.

        Raises:
            ConfigError: the cluster cannot hold the ranks.
            LaunchError: the bundles or the actors were not ready within ``start_timeout`` seconds,
                or an actor failed to start; nothing is left on the cluster.
            BaseException: an interrupt while starting; nothing is left on the cluster.
        """
        ray = require_ray()
        plan = request.plan
        use_gpu = plan.device_kind == "cuda"
        placement = place_bundles(plan.num_processes, use_gpu, request.config.ray_placement_strategy, start_timeout)
        actors: list[Any] = []
        try:
            remote = ray.remote(RankActor)
            for index in range(plan.num_processes):
                actors.append(remote.options(num_cpus=1, num_gpus=1 if use_gpu else 0, max_concurrency=_ACTOR_THREADS,
                                             scheduling_strategy=placement.strategy_for(index)).remote())
            sites = [RankSite(**site) for site in _get(ray, [a.where.remote(i) for i, a in enumerate(actors)],
                                                       start_timeout, "start")]
            layouts = {layout.bundle: layout for layout in layout_ranks(sites)}
            members = sorted((RankMember(rank=layouts[s.bundle].rank, actor=actors[s.bundle], site=s,
                                         layout=layouts[s.bundle]) for s in sites), key=lambda m: m.rank)
            first = members[0]
            port = _get(ray, [first.actor.host_store.remote(first.site.ip, start_timeout)], start_timeout,
                        "host the rendezvous store")[0]
            nodes = len({m.site.node_id for m in members})
            envs = _environments(request, members, first.site.ip, port, nodes)
            preparing = [m.actor.prepare.remote(env, request.lifecycle) for m, env in zip(members, envs)]
            _get(ray, preparing, start_timeout, "prepare")
            ranks = cls(placement, members, nodes)
            if join_group:
                _get(ray, [m.actor.join_group.remote() for m in members], start_timeout, "join the process group")
            return ranks
        except BaseException:
            for actor in actors:
                ray.kill(actor, no_restart=True)
            placement.remove()
            raise

    # ------------------------------------------------------------------ running
    def run(self, function: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], *,
            run: SupervisedRun, return_all: bool, cpu_results: bool = False) -> dict[int, Any]:
        """Run ``function`` on every rank under ``run``'s supervisor, as a local launch's; ``{rank: result}``.

        Raises:
            PayloadPicklingError: the function or an argument cannot be pickled (nothing ran).
            WorkerFailedError: the root-cause rank's exception (the family of every launcher).
            LaunchTimeoutError: the request's ``timeout`` passed, or the hang watchdog fired.
            KeyboardInterrupt: the caller was interrupted; every rank was interrupted, or killed
                after ``run.policy.grace``.
        """
        ray = require_ray()
        payload = ray.put(dumps_payload(function, args, kwargs))
        run_id = next(self._runs)
        handles = [RayRankHandle.open(m.rank, m.actor, m.site.pid) for m in self.members]
        refs = [m.actor.run.remote(run_id, payload, m.rank, return_all or m.rank == 0, cpu_results)
                for m in self.members]
        pump = RunPump(handles, refs, run_id).start()
        try:
            return run.supervise(handles).get()
        finally:
            pump.stop()
            for handle in handles:
                handle.close_writers()
            lost = [f"rank {h.rank} was killed (it did not stop within the grace period)" if h.killed_at is not None
                    else f"rank {h.rank}'s actor died ({h.died})" for h in handles if h.died or h.killed_at is not None]
            self.lost = self.lost or "; ".join(lost) or None

    def lost_ranks(self, timeout: float = 10.0) -> list[int]:
        """Ranks whose actors are gone: killed after a run's grace period, or died (their node, say)."""
        ray = require_ray()
        refs = [m.actor.where.remote(m.site.bundle) for m in self.members]
        ray.wait(refs, num_returns=len(refs), timeout=timeout)
        gone = []
        for member, ref in zip(self.members, refs):
            try:
                ray.get(ref, timeout=0)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                gone.append(member.rank)
        return gone

    # ------------------------------------------------------------------ ending
    def shutdown(self) -> None:
        """Kill every actor and remove the placement group; nothing of the job stays on the cluster."""
        if self._closed:
            return
        self._closed = True
        ray = require_ray()
        if ray.is_initialized():
            for member in self.members:
                try:
                    ray.kill(member.actor, no_restart=True)
                except Exception:  # noqa: BLE001 - already gone
                    pass
        self.placement.remove()


def _get(ray: Any, refs: list[Any], timeout: float, what: str) -> list[Any]:
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise LaunchError(f"the Ray actors did not {what} within {timeout:g}s (a node busy installing a runtime "
                          "environment, or one that cannot import nbaccel and torch). Fix: check `ray status` and "
                          "the actors' logs; pass a larger start_timeout.") from None
    except ray.exceptions.RayError as exc:
        raise LaunchError(f"a Ray actor failed to {what}: {exc}. Nothing was left on the cluster. Fix: make sure "
                          "every node can import nbaccel and torch (the same versions as here).") from exc


def _environments(request: LaunchRequest, members: Sequence[RankMember], master_addr: str, port: int,
                  nodes: int) -> list[dict[str, str]]:
    """Each rank's environment: a local worker's, with the cluster's layout and rank 0's store."""
    n = len(members)
    settings = dataclasses.replace(request.plan.settings, num_machines=nodes)
    loopback = all(ipaddress.ip_address(m.site.ip).is_loopback for m in members)  # one machine after all
    return [worker_environment(
        settings, DistributedEnv(rank=m.rank, local_rank=m.layout.local_rank, world_size=n,
                                 local_world_size=m.layout.local_world_size, node_rank=m.layout.node_rank,
                                 master_addr=master_addr, master_port=port),
        agent_store=True, loopback_only=loopback, threads=m.layout.threads, visible_gpus=m.layout.visible_gpus)
        for m in members]
