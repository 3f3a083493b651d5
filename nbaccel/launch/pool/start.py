"""Starting a warm pool's workers and tearing them down: the pool's processes, sockets and store.

:func:`start_pool` makes a private Unix socket (in a 0700 folder) that each rank connects to, a
loopback rendezvous store (several workers) kept for the pool's life, forks or spawns the workers
(running :func:`~nbaccel.launch.pool.serve.serve`) from the owner thread
(:mod:`nbaccel.launch.owner_thread`), and waits for every rank's ``ready`` or the first failure.
:meth:`PoolProcesses.shutdown` kills each worker's process group; nothing is left running, bound
or on disk. If the owner dies first, the group reaper (:mod:`nbaccel.launch.reaper`) kills the
groups and removes the folder.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from nbaccel.errors import LaunchError
from nbaccel.launch.failures import RankError, WorkerFailure, raise_failures, rank_failure
from nbaccel.launch.frames import FrameReader
from nbaccel.launch.handles import REAP_TIMEOUT, WorkerHandle, wait_reaped
from nbaccel.launch.local.starter import SpawnFiles, local_environments, start_forked, start_spawned
from nbaccel.launch.owner_thread import on_owner_thread
from nbaccel.launch.pool.channels import PoolChannels, PoolMember
from nbaccel.launch.pool.serve import serve
from nbaccel.launch.reaper import GroupReaper, group_reaper
from nbaccel.launch.rendezvous import LoopbackStore
from nbaccel.launch.request import LaunchRequest
from nbaccel.launch.warmup import finish_warmup, start_warmup

__all__ = ["PoolProcesses", "start_pool"]

_STOP_GRACE = 5.0  # an idle worker exits on SIGTERM in milliseconds; a busy one may be in native code


class PoolProcesses:
    """A started pool: its members, the channels to them, its store and its private folder."""

    def __init__(self, members: list[PoolMember], channels: PoolChannels, store: LoopbackStore | None,
                 folder: Path, reaper: GroupReaper) -> None:
        self.members = members
        self.channels = channels
        self.store = store
        self.folder = folder
        self.reaper = reaper
        self.closed = False
        self.owner = os.getpid()
        """The process that started the workers: only it may stop them (a forked child of it shares these
        objects, and its exit runs their finalizers)."""

    def kill(self, members: list[PoolMember] | None = None) -> None:
        """SIGKILL ``members`` (default: all) with whatever they started, and reap them.

        Every worker leads its own process group (the starter puts it there), so the signal goes
        to the group: a child it started (a DataLoader worker, a subprocess) goes with it, also
        when the worker itself had already died. A no-op outside the :attr:`owner` process.
        """
        if os.getpid() != self.owner:
            return
        targets = members if members is not None else self.members
        for member in targets:
            member.handle.send_tree(signal.SIGKILL)
        try:  # bounded: a worker stuck in the kernel is named, not waited for forever
            wait_reaped([m.handle for m in targets], REAP_TIMEOUT)
        finally:
            for member in targets:
                member.handle.kill_leftovers()

    def shutdown(self) -> None:
        """End every worker and what it started, free the port and the folder; safe to call again.

        Each worker is first sent ``SIGTERM``, on which it ends every process it started, daemons
        that left its process group included (:mod:`nbaccel.launch.worker.descendants`); whoever has not
        exited within :data:`_STOP_GRACE` seconds is killed with its group. A no-op outside the
        :attr:`owner` process: a forked child's exit must not stop its parent's workers.
        """
        if self.closed or os.getpid() != self.owner:
            return
        self.closed = True
        try:
            for member in self.members:
                member.handle.send(signal.SIGTERM)
            deadline = time.monotonic() + _STOP_GRACE
            while any(m.handle.poll() is None for m in self.members) and time.monotonic() < deadline:
                time.sleep(0.005)
            self.kill()
        finally:
            for member in self.members:  # killed and reaped: their groups are gone
                self.reaper.forget(member.handle.pid)
            self.channels.close()
            if self.store is not None:
                self.store.close()
            shutil.rmtree(self.folder, ignore_errors=True)
            self.reaper.forget_folder(str(self.folder))


def _start_processes(request: LaunchRequest, path: Path, listener: socket.socket,
                     store: LoopbackStore | None, files: SpawnFiles | None, reaper: GroupReaper) -> list[WorkerHandle]:
    envs = local_environments(request, store)
    if files is not None:
        handles = on_owner_thread(start_spawned, serve, (str(path), request.lifecycle), {}, envs, files, None, None,
                                  request.lifecycle)
    else:
        if request.warm_imports is not False:
            start_warmup()  # warm workers build models: pay torch._dynamo's import once, here, not in each
        finish_warmup()
        inherited = [listener.fileno(), reaper.fd] + (store.listen_fds if store is not None else [])
        handles = on_owner_thread(start_forked, serve, (str(path), request.lifecycle), {}, envs, inherited, None,
                                  request.lifecycle)
    for handle in handles:  # if this process is killed, the reaper stops what they started
        reaper.watch(handle.pid)
    return handles


def start_pool(request: LaunchRequest, start_timeout: float = 300.0) -> PoolProcesses:
    """Start ``request.num_processes`` pool workers and wait until each has joined the process group.

    Raises:
        WorkerFailedError: a worker failed while starting (every worker was stopped).
        LaunchError: the workers did not all start within ``start_timeout`` seconds.
        KeyboardInterrupt: the caller was interrupted (every worker was stopped).
    """
    n = request.num_processes
    deadline = time.monotonic() + start_timeout  # starting the processes counts too
    reaper = group_reaper()  # before the store's thread exists
    folder = Path(tempfile.mkdtemp(prefix="nbaccel-pool-"))  # mode 0700: only this user reaches the socket
    reaper.watch_folder(str(folder))
    path = folder / "pool.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(n)
    store = LoopbackStore(port=request.config.main_process_port or 0) if n > 1 else None
    processes: PoolProcesses | None = None
    files = SpawnFiles() if request.plan.start_method == "spawn" else None
    try:
        handles = _start_processes(request, path, listener, store, files, reaper)
        members = [PoolMember(rank=h.rank, handle=h) for h in handles]
        processes = PoolProcesses(members, PoolChannels(members), store, folder, reaper)
        if store is not None:
            store.serve([h.pid for h in handles])  # only now: no store thread runs while forking
        _accept(processes, listener, deadline, start_timeout)
        _wait_ready(processes, deadline, start_timeout)
        return processes
    except BaseException:
        if processes is not None:
            processes.shutdown()
        else:
            if store is not None:
                store.close()
            shutil.rmtree(folder, ignore_errors=True)
            reaper.forget_folder(str(folder))
        raise
    finally:
        listener.close()
        if files is not None:
            files.remove()  # every worker read its spec and payload before it said hello (or it is gone)


def _check_deadline(processes: PoolProcesses, deadline: float, start_timeout: float) -> None:
    if time.monotonic() > deadline:
        late = [m.rank for m in processes.members if not m.ready]
        raise LaunchError(f"pool workers {late} did not start (connect and join the process group) within "
                          f"start_timeout={start_timeout:g}s; every worker was stopped. Fix: look at their output "
                          "above, or pass a larger start_timeout= when many workers share few cores.")


def _accept(processes: PoolProcesses, listener: socket.socket, deadline: float, start_timeout: float) -> None:
    """Take one connection per rank; each starts with a ``hello`` frame naming the rank."""
    listener.settimeout(0.05)
    by_rank = {m.rank: m for m in processes.members}
    waiting = set(by_rank)
    while waiting:
        _check_deadline(processes, deadline, start_timeout)
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            _check_starting(processes, 0)
            continue
        conn.settimeout(30)
        reader = FrameReader()
        frames: list[tuple[str, Any]] = []
        while not frames:
            data = conn.recv(4096)
            if not data:
                break
            frames = list(reader.feed(data))
        conn.settimeout(None)
        if not frames or frames[0][0] != "hello" or frames[0][1] not in waiting:
            conn.close()
            continue
        member = by_rank[frames[0][1]]
        member.frames = reader  # frames after the hello stay in its buffer
        processes.channels.add_socket(member, conn)
        waiting.discard(member.rank)
        for kind, body in frames[1:]:
            _on_start_event(processes, member, kind, body)


def _check_starting(processes: PoolProcesses, wait: float) -> None:
    failures = []
    for member, kind, body in processes.channels.pump(wait):
        failure = _on_start_event(processes, member, kind, body)
        if failure is not None:
            failures.append(failure)
    if failures:
        processes.kill()
        raise_failures(failures, len(processes.members))


def _on_start_event(processes: PoolProcesses, member: PoolMember, kind: str, body: object) -> WorkerFailure | None:
    if kind == "ready":
        member.ready, member.device = True, body["device"]  # type: ignore[index]  # a ready frame's body is a dict
    elif kind == "ctl:error":
        member.error = RankError.from_frame(body)  # type: ignore[arg-type]  # a ctl:error frame's body is the error dict
    elif kind == "exit":
        for _, later, error in processes.channels.drain(member):
            if later == "ctl:error":  # the report may still have been in the pipe
                member.error = RankError.from_frame(error)
        return rank_failure(member.rank, member.handle.pid, member.handle.reaped, member.error)
    return None


def _wait_ready(processes: PoolProcesses, deadline: float, start_timeout: float) -> None:
    while not all(m.ready for m in processes.members):
        _check_deadline(processes, deadline, start_timeout)
        _check_starting(processes, 0.05)
    # Each worker's body said "started" (for serve itself) on its control pipe before it connected:
    # read it now, or the first task's supervisor would take it for the task's own start.
    _check_starting(processes, 0)
