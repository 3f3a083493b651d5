"""Launching on TPUs (and torch_xla's CPU runtime) through ``torch_xla.launch``, with nbaccel's promises.

``torch_xla.launch`` starts one process per TPU chip and, inside each, one thread per XLA device
(on the CPU runtime ``CPU_NUM_DEVICES`` threads in one process), and discards what the function
returns. nbaccel forks a host process (its own process group) that calls it; the caller creates a
control, stdout and stderr pipe per rank before forking, so every replica reports on its own pipes
to the usual supervisor, with the host as its ``host`` (not a rank). Every replica runs the local
worker body (:func:`~nbaccel.launch.worker.process.run_body`), with its identity set per thread
when replicas share a process. Where replica threads share a process, only Python-level writes
from the replica's own thread are labelled with its rank; the rest is shown as ``[xla]``.

Where torch_xla limits the promises:

- A replica cannot be stopped alone: the first failure stops the whole process group.
- When a replica process dies in native code, torch_xla only reports a broken process pool, so
  every rank that had not reported is named; its Python stacks are in the ``[xla]`` or rank output.
- Replica processes are torch_xla's: they die with the host, the host with the caller, and the
  host's process group is killed when the launch ends (unless a replica calls ``setsid``).
- Only fork: the notebook must not have initialized the XLA runtime (then restart the kernel).
- ``num_processes`` is 1 or every device the runtime reports (any count on the CPU runtime).
"""

from __future__ import annotations

import faulthandler
import io
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from nbaccel.environment import (
    DistributedEnv,
    WorkerSettings,
    apply_environment,
    worker_environment,
)
from nbaccel.host_memory import group_members
from nbaccel.identity import WorkerIdentity, current_identity
from nbaccel.launch.backend import Backend
from nbaccel.launch.failures import ProcessExit
from nbaccel.launch.handles import WorkerHandle
from nbaccel.launch.output import Stream
from nbaccel.rank_lifecycle import RankLifecycle
from nbaccel.launch.request import LaunchRequest
from nbaccel.launch.supervised_run import Lifetime, SupervisedRun
from nbaccel.launch.warmup import finish_warmup
from nbaccel.launch.xla.topology import plan_xla_launch
from nbaccel.launch.worker.display import flush_quietly
from nbaccel.launch.worker.process import (
    WorkerSpec,
    die_with_parent,
    run_body,
    run_worker,
)

__all__ = ["BACKEND", "HOST_RANK", "LAUNCHER", "XlaLauncher", "current_replica"]

HOST_RANK = -1
"""The pseudo-rank of the torch_xla host process in output labels and failure reports."""

# --------------------------------------------------------------------------- replica side


@dataclass(frozen=True)
class _ReplicaJob:
    """What every replica needs; set in the host before ``torch_xla.launch`` forks the replicas."""

    function: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    world_size: int
    pipes: tuple[tuple[int, int, int], ...]  # (ctl, stdout, stderr) write ends, per rank
    host_pid: int
    settings: WorkerSettings


_JOB: _ReplicaJob | None = None
_local = threading.local()
_process_lock = threading.Lock()
_process_pid: int | None = None  # the process whose one-time replica setup has run


def current_replica() -> WorkerIdentity | None:
    """The calling replica's identity, inside a function started by the XLA launcher; else ``None``.

    The same :class:`~nbaccel.identity.WorkerIdentity` that :func:`nbaccel.identity.current_identity`
    gives there (``shares_process`` tells whether replicas run as threads of one process).

    Example:
        >>> current_replica() is None  # outside a launch
        True
    """
    return current_identity() if getattr(_local, "active", False) else None


class _RoutedStream(io.TextIOBase):
    """``sys.stdout``/``sys.stderr`` of a process with several replica threads: each writes to its own pipe."""

    def __init__(self, name: Stream, fallback: TextIO) -> None:
        self._name = name
        self._fallback = fallback

    def _target(self) -> TextIO:
        streams = getattr(_local, "streams", None)
        return streams[self._name] if streams else self._fallback

    def write(self, text: str) -> int:
        return self._target().write(text)

    def flush(self) -> None:
        self._target().flush()

    def fileno(self) -> int:
        return self._target().fileno()

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:  # type: ignore[override]  # a property where TextIO has an attribute
        return "utf-8"


def _line_stream(fd: int) -> TextIO:
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), line_buffering=True, write_through=True)


def _setup_process_once(job: _ReplicaJob) -> bool:
    """One-time setup of a replica process; returns whether replicas share it as threads."""
    global _process_pid
    import torch_xla.runtime as xr

    with _process_lock:
        shared = xr.addressable_device_count() > 1
        if _process_pid != os.getpid():
            _process_pid = os.getpid()
            if os.getpid() != job.host_pid:
                die_with_parent(job.host_pid)
            if shared:
                sys.stdout = _RoutedStream("stdout", sys.stdout)
                sys.stderr = _RoutedStream("stderr", sys.stderr)
                faulthandler.enable(all_threads=True)  # native crashes: every thread's stack, [xla]-labelled
        return shared


def _enter_replica(job: _ReplicaJob, rank: int) -> WorkerIdentity:
    """Point this replica's output at its pipes; return who it is."""
    shared = _setup_process_once(job)
    _, out_fd, err_fd = job.pipes[rank]
    _local.active = True
    if shared:
        _local.streams = {"stdout": _line_stream(out_fd), "stderr": _line_stream(err_fd)}
        return WorkerIdentity(rank=rank, local_rank=rank, world_size=job.world_size,
                              local_world_size=job.world_size, shares_process=True)
    # the only replica here: the whole process's output is this rank's
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    sys.stdout, sys.stderr = _line_stream(1), _line_stream(2)
    vars(sys).update(__stdout__=sys.stdout, __stderr__=sys.stderr)  # the originals too (Final in typeshed only)
    faulthandler.enable(all_threads=True)
    if job.world_size == 1:
        return WorkerIdentity()
    import torch_xla.runtime as xr  # one process per replica (TPU v4 and later): torchrun's variables work

    dist = DistributedEnv(rank=rank, local_rank=xr.local_ordinal(), world_size=job.world_size,
                          local_world_size=xr.local_device_count(), node_rank=0,
                          master_addr="127.0.0.1", master_port=0)
    apply_environment(worker_environment(job.settings, dist))
    return WorkerIdentity.from_distributed_env(dist)


def _leave_replica() -> None:
    flush_quietly(*(getattr(_local, "streams", None) or {}).values())
    _local.streams = None
    _local.active = False
    flush_quietly(sys.stdout, sys.stderr)


def _replica_main(index: int) -> None:
    """What ``torch_xla.launch`` runs in every replica: the shared worker body, on this rank's pipe."""
    job = _JOB
    assert job is not None, "nbaccel's XLA replica entry ran outside the XLA launcher"
    ctl_fd = job.pipes[index][0]
    try:
        try:
            identity = _enter_replica(job, index)
        except BaseException as exc:  # noqa: BLE001 - reported like a failure of the function
            run_body(ctl_fd, index, None, _reraise, (exc,), {}, per_thread=True)
            return
        run_body(ctl_fd, index, identity, job.function, job.args, job.kwargs, per_thread=identity.shares_process)
    finally:
        _leave_replica()


def _reraise(exc: BaseException) -> None:
    raise exc


def _host_main(job: _ReplicaJob, single: bool) -> None:
    """The host process (nbaccel's settings already in its environment): run the replicas."""
    global _JOB
    if os.environ.get("PJRT_DEVICE", "").upper() == "CPU":  # the CPU runtime runs any count asked for
        apply_environment({"CPU_NUM_DEVICES": str(job.world_size)})
    _JOB = job
    import torch_xla

    torch_xla.launch(_replica_main, start_method="fork", debug_single_process=single)


# --------------------------------------------------------------------------- caller side


class _HostHandle(WorkerHandle):
    """The host process; signals go to its whole process group (the host and every replica)."""

    def send(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


@dataclass
class _ReplicaHandle(WorkerHandle):
    """One replica, seen through its pipes: it has ended once it reported, or once the host is gone."""

    host: _HostHandle | None = None
    reply_ends_run: ProcessExit | None = ProcessExit()  # noqa: RUF009  # frozen: one shared instance is safe

    def poll(self) -> ProcessExit | None:
        if self.reaped is None and self._host_gone():
            self.reaped = ProcessExit()
        return self.reaped

    def _host_gone(self) -> bool:
        host = self.host
        assert host is not None
        if host.exited:
            return True
        try:  # peek without reaping: the host's own exit is handled on its handle
            return os.waitid(os.P_PID, host.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True

    def send(self, sig: int) -> None:
        if self.host is not None:
            self.host.send(sig)


def _start_host(function: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], n: int,
                settings: WorkerSettings, env: Mapping[str, str],
                lifecycle: RankLifecycle) -> tuple[_HostHandle, list[_ReplicaHandle]]:
    """Fork the host process (its own process group) with a control/stdout/stderr pipe per rank."""
    host_pipes = [os.pipe() for _ in range(3)]
    rank_pipes = [[os.pipe() for _ in range(3)] for _ in range(n)]
    read_ends = [r for r, _ in host_pipes] + [r for trio in rank_pipes for r, _ in trio]
    parent = os.getpid()
    finish_warmup()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork with threads
        pid = os.fork()
    if pid == 0:  # the host; never returns
        try:
            os.setpgid(0, 0)  # Jupyter's interrupt (sent to the kernel's group) reaches only the caller
            job = _ReplicaJob(function=function, args=tuple(args), kwargs=dict(kwargs), world_size=n,
                              pipes=tuple(tuple(w for _, w in trio) for trio in rank_pipes),  # type: ignore[misc]  # three write ends per rank
                              host_pid=os.getpid(), settings=settings)
            spec = WorkerSpec(rank=HOST_RANK, env=env, ctl_fd=host_pipes[0][1], parent_pid=parent,
                              out_fd=host_pipes[1][1], err_fd=host_pipes[2][1], close_fds=read_ends,
                              lifecycle=lifecycle)
        except BaseException:  # noqa: BLE001 - the forked child must never return into the caller's code
            os._exit(1)
        run_worker(spec, _host_main, (job, n == 1), {})
    try:
        os.setpgid(pid, pid)  # also here, so signals reach the group even before the child ran
    except (PermissionError, ProcessLookupError):
        pass
    for trio in [host_pipes, *rank_pipes]:
        for _, write_end in trio:
            os.close(write_end)
    host = _HostHandle(rank=HOST_RANK, pid=pid, ctl_fd=host_pipes[0][0], out_fd=host_pipes[1][0],
                       err_fd=host_pipes[2][0])
    replicas = [_ReplicaHandle(rank=r, pid=pid, ctl_fd=trio[0][0], out_fd=trio[1][0], err_fd=trio[2][0], host=host)
                for r, trio in enumerate(rank_pipes)]
    return host, replicas


class XlaLauncher:
    """Runs a request on every XLA device through ``torch_xla.launch`` (fork only; see the module docstring).

    Example:
        >>> def where():
        ...     import torch_xla.runtime as xr
        ...     return xr.global_ordinal()
        >>> notebook_launcher(where, config=LaunchConfig(distributed_type="XLA"))  # doctest: +SKIP
        0
    """

    name = "xla"

    def launch(self, request: LaunchRequest) -> dict[int, Any]:
        """Fork the host, let torch_xla start the replicas, supervise them to the end."""
        n = request.num_processes
        import torch_xla  # noqa: F401 - imported once here (about 5 s), not in every host process

        settings: WorkerSettings = request.plan.settings
        env = worker_environment(settings, threads=request.plan.threads)
        lifetime = Lifetime("fork", host_name="torch_xla.launch in the host process", labels={HOST_RANK: "xla"})
        with SupervisedRun(request, lifetime) as run:
            host, replicas = _start_host(request.function, request.args, request.kwargs, n, settings, env,
                                            request.lifecycle)
            try:
                return run.supervise(replicas, host=host).get()
            finally:
                _kill_group(host.pid)


def _kill_group(pgid: int, wait: float = 10.0) -> None:
    """SIGKILL whatever is left in the host's process group, and wait until it is gone.

    Waiting matters on a TPU: a replica process holds the chips until the kernel has reclaimed
    it, so a launch that returned earlier could make an immediate relaunch find the TPU busy.
    """
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + wait
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.01)


LAUNCHER = XlaLauncher()
BACKEND = Backend(LAUNCHER, plan=plan_xla_launch)
