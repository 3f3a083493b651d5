"""The local launcher: this machine's workers, started by fork or spawn, watched by the supervisor.

A loopback rendezvous store (several workers), the workers from
:mod:`nbaccel.launch.local.starter`, and one :class:`~nbaccel.launch.supervised_run.SupervisedRun`.
"""

from __future__ import annotations

from typing import Any

from nbaccel.launch.backend import Backend, PoolRanks
from nbaccel.launch.handles import discard_workers
from nbaccel.launch.local.starter import SpawnFiles, local_environments, start_forked, start_spawned
from nbaccel.launch.payload import dumps_payload
from nbaccel.launch.reaper import group_reaper
from nbaccel.launch.rendezvous import LoopbackStore
from nbaccel.launch.request import LaunchRequest
from nbaccel.launch.supervised_run import Lifetime, SupervisedRun
from nbaccel.launch.warmup import finish_warmup, prepare_to_fork

__all__ = ["BACKEND", "LAUNCHER", "LocalLauncher", "local_environments"]


class LocalLauncher:
    """Runs a request's workers on this machine (fork when safe, else spawn)."""

    name = "local"

    def launch(self, request: LaunchRequest) -> dict[int, Any]:
        """Start ``request.num_processes`` workers and supervise them to the end."""
        plan = request.plan
        n = plan.num_processes
        function, args, kwargs = request.function, request.args, request.kwargs
        payload = dumps_payload(function, args, kwargs) if plan.start_method == "spawn" else None  # fail early
        # Before anything else starts: no import may run beside the rendezvous store's threads.
        if payload is None:
            prepare_to_fork(function, request.warm_imports)
        else:
            finish_warmup()  # a cell's background warm-up, if one runs
        reaper = group_reaper()  # before the store's thread exists: it forks
        store = LoopbackStore(port=request.config.main_process_port or 0) if n > 1 else None
        files = SpawnFiles() if payload is not None else None
        try:
            envs = local_environments(request, store)
            with SupervisedRun(request, Lifetime(plan.start_method)) as run:
                wanted = None if request.return_all else {0}  # the others' values are never pickled
                if files is not None:
                    handles = start_spawned(function, args, kwargs, envs, files, payload=payload, result_ranks=wanted,
                                            lifecycle=request.lifecycle)
                else:
                    handles = start_forked(function, args, kwargs, envs, result_ranks=wanted,
                                           lifecycle=request.lifecycle,
                                           inherited_fds=[reaper.fd] + (store.listen_fds if store else []))
                for handle in handles:  # if this process is killed, the reaper stops what they started
                    reaper.watch(handle.pid)
                try:
                    if store is not None:
                        try:
                            store.serve([h.pid for h in handles])  # only now: no store thread runs while forking
                        except BaseException:
                            discard_workers(handles)
                            raise
                    return run.supervise(handles).get()
                finally:  # the run has stopped every group by now
                    for handle in handles:
                        reaper.forget(handle.pid)
        finally:
            if store is not None:
                store.close()
            if files is not None:
                files.remove()


def _start_pool(request: LaunchRequest, start_timeout: float) -> PoolRanks:
    """A ``WorkerPool``'s ranks on this machine (imported here: a one-shot launch never loads the pool's modules)."""
    from nbaccel.launch.pool.local_ranks import LocalPoolRanks

    return LocalPoolRanks.start(request, start_timeout)


LAUNCHER = LocalLauncher()
BACKEND = Backend(LAUNCHER, start_pool=_start_pool)
