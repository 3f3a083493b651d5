"""Starting the worker processes of one machine, by fork or by spawn.

Fork runs the function straight from the caller's memory (about 0.02 s per worker). Spawn starts
fresh interpreters running :mod:`nbaccel.launch.worker.trampoline`, with the function shipped by value
through cloudpickle in a private file.
"""

from __future__ import annotations

import gc
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import cloudpickle

from nbaccel.environment import DistributedEnv, child_base_environment, worker_environment
from nbaccel.launch.base import LaunchRequest
from nbaccel.launch.handles import WorkerHandle, discard_workers
from nbaccel.launch.payload import dumps_payload
from nbaccel.rank_lifecycle import RankLifecycle
from nbaccel.launch.rendezvous import LoopbackStore
from nbaccel.launch.worker.process import WorkerSpec, run_worker

__all__ = ["SpawnFiles", "local_environments", "start_forked", "start_spawned"]


# A spawned worker leads its own process group, as a forked one does (``process_group`` is 3.11+).
_OWN_GROUP: dict[str, Any] = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}


def _pipes(n: int) -> list[tuple[tuple[int, int], tuple[int, int], tuple[int, int]]]:
    """``n`` trios of (read, write) pipes; on failure (EMFILE) the ones already opened are closed."""
    opened: list[tuple[int, int]] = []
    try:
        for _ in range(3 * n):
            opened.append(os.pipe())
    except BaseException:
        for read_end, write_end in opened:
            os.close(read_end)
            os.close(write_end)
        raise
    return [(opened[i], opened[i + 1], opened[i + 2]) for i in range(0, 3 * n, 3)]


def start_forked(function: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
                 envs: Sequence[Mapping[str, str]], inherited_fds: Sequence[int] = (),
                 result_ranks: Collection[int] | None = None,
                 lifecycle: RankLifecycle | None = None) -> list[WorkerHandle]:
    """Fork one worker per entry of ``envs`` (rank = index) and return their handles.

    Only the ranks in ``result_ranks`` (all when ``None``) send their return value back; each starts
    afresh through ``lifecycle`` (``None``: nbaccel's).
    """
    pipes = _pipes(len(envs))
    all_fds = [fd for trio in pipes for pair in trio for fd in pair]
    parent = os.getpid()
    handles: list[WorkerHandle] = []
    # Frozen, the caller's objects are skipped by the workers' collections: a forked worker's
    # gc.collect() (its teardown runs one) would otherwise walk every object the notebook holds,
    # writing to each one's header and so copying the pages (0.35-0.45 s per worker here, with
    # torch imported). Unfrozen right after: this process collects them as before.
    gc.freeze()
    try:
        for rank, env in enumerate(envs):
            (ctl_r, ctl_w), (out_r, out_w), (err_r, err_w) = pipes[rank]
            own = {ctl_w, out_w, err_w}
            # Ctrl-C is held off across the fork: raised inside the parent's after-fork callbacks
            # (logging's lock release) it is printed as "Exception ignored" and lost, and the
            # launch would run on; held, it is raised at the unblock below, where it stops the launch.
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork with threads
                    pid = os.fork()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            if pid == 0:  # the worker; never returns
                os.setpgid(0, 0)  # its own group: what it starts is stopped with it, and a terminal's or
                # Jupyter's interrupt reaches the launcher, which stops the workers in order
                spec = WorkerSpec(rank=rank, env=env, ctl_fd=ctl_w, parent_pid=parent, out_fd=out_w, err_fd=err_w,
                                  close_fds=[fd for fd in all_fds if fd not in own] + list(inherited_fds),
                                  send_result=result_ranks is None or rank in result_ranks,
                                  lifecycle=lifecycle or RankLifecycle())
                run_worker(spec, function, args, kwargs)
            try:
                os.setpgid(pid, pid)  # also here, so the group exists before the child has run
            except (ProcessLookupError, PermissionError):
                pass
            handles.append(WorkerHandle(rank=rank, pid=pid, ctl_fd=ctl_r, out_fd=out_r, err_fd=err_r, group=True))
    except BaseException:  # fork refused (EAGAIN, ENOMEM) or interrupted: nothing may stay behind
        discard_workers(handles)
        for fd in all_fds:
            if not any(fd in (h.ctl_fd, h.out_fd, h.err_fd) for h in handles):
                os.close(fd)
        raise
    finally:
        gc.unfreeze()
    for trio in pipes:
        for _, write_end in trio:
            os.close(write_end)
    return handles


class SpawnFiles:
    """The private directory holding a spawn launch's payload and per-rank specs."""

    def __init__(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="nbaccel-spawn-"))  # mode 0700

    def write(self, name: str, data: bytes) -> Path:
        target = self.path / name
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        return target

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _python_path() -> str:
    entries = [p for p in sys.path if p and os.path.isdir(p)]
    package_root = str(Path(__file__).resolve().parents[3])
    return os.pathsep.join(dict.fromkeys([package_root, *entries]))


def start_spawned(function: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
                  envs: Sequence[Mapping[str, str]], files: SpawnFiles,
                  payload: bytes | None = None, result_ranks: Collection[int] | None = None,
                  lifecycle: RankLifecycle | None = None) -> list[WorkerHandle]:
    """Start one fresh interpreter per entry of ``envs`` running the cloudpickled function.

    Only the ranks in ``result_ranks`` (all when ``None``) send their return value back; each starts
    afresh through ``lifecycle`` (``None``: nbaccel's; cloudpickled with its spec, so the notebook may define it).

    Raises:
        PayloadPicklingError: the function or an argument cannot be pickled (nothing started).
    """
    payload = payload if payload is not None else dumps_payload(function, args, kwargs)
    payload_path = files.write("payload.pkl", payload)
    base = child_base_environment()
    base["PYTHONPATH"] = _python_path()
    pipes = _pipes(len(envs))
    all_fds = [fd for trio in pipes for pair in trio for fd in pair]
    handles: list[WorkerHandle] = []
    try:
        # Every spec is written before any worker starts: the last worker to read the payload removes
        # the folder (a launcher killed mid-run leaves nothing in /tmp), which it may only do once no
        # spec is left to read.
        spec_paths = [files.write(f"spec-{rank}.pkl", cloudpickle.dumps(
            WorkerSpec(rank=rank, env=env, ctl_fd=pipes[rank][0][1], parent_pid=os.getpid(),
                       send_result=result_ranks is None or rank in result_ranks,
                       lifecycle=lifecycle or RankLifecycle())))
            for rank, env in enumerate(envs)]
        for rank, env in enumerate(envs):
            (ctl_r, ctl_w), (out_r, out_w), (err_r, err_w) = pipes[rank]
            popen = subprocess.Popen(
                [sys.executable, "-m", "nbaccel.launch.worker.trampoline", str(spec_paths[rank]), str(payload_path)],
                stdin=subprocess.DEVNULL, stdout=out_w, stderr=err_w, pass_fds=(ctl_w,),
                env={**base, **env}, close_fds=True, **_OWN_GROUP)
            handles.append(WorkerHandle(rank=rank, pid=popen.pid, ctl_fd=ctl_r, out_fd=out_r, err_fd=err_r,
                                        popen=popen, group=True))
    except BaseException:
        discard_workers(handles)
        for fd in all_fds:
            if not any(fd in (h.ctl_fd, h.out_fd, h.err_fd) for h in handles):
                os.close(fd)
        raise
    for trio in pipes:
        for _, write_end in trio:
            os.close(write_end)
    return handles


def local_environments(request: LaunchRequest, store: LoopbackStore | None) -> list[dict[str, str]]:
    """Each rank's environment for workers on this machine meeting at ``store`` on loopback."""
    plan, n = request.plan, request.num_processes
    envs = []
    for rank in range(n):
        dist = DistributedEnv(rank=rank, local_rank=rank, world_size=n, local_world_size=n, node_rank=0,
                              master_addr="127.0.0.1", master_port=store.port if store else 0) if n > 1 else None
        envs.append(worker_environment(plan.settings, dist, agent_store=store is not None, loopback_only=True,
                                       threads=plan.threads, visible_gpus=plan.visible_gpus))
    return envs
