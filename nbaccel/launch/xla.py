"""Launching on TPUs (and torch_xla's CPU runtime) through ``torch_xla.launch``, with nbaccel's promises.

``torch_xla.launch`` starts one process per TPU chip and, inside each, one thread per XLA device
(two per chip on TPU v2/v3, one on v4 and later; on the CPU runtime ``CPU_NUM_DEVICES`` threads
in one process). It discards what the function returns. nbaccel wraps it like this::

    notebook (supervisor)  ──fork──►  host process (own process group)
        ▲  per-rank pipes                 └─ torch_xla.launch(start_method="fork")
        │  ctl / stdout / stderr               └─ replica process × chips
        └──────────────────────────────────────────└─ replica thread × devices per chip

The caller creates a control, stdout and stderr pipe per rank before forking the host, so every
replica, whichever process or thread it runs in, reports ``started`` / ``result`` / ``error``
frames on its own pipe and the usual :class:`~nbaccel.launch.supervisor.Supervisor` reads them:
output arrives labelled per rank, results of any size come back (moved to CPU), and the first
failure is raised with its remote traceback.

Output: a replica process that holds one replica points its fd 1 and 2 at that rank's pipes, so
even C++ output is labelled. Where several replica threads share a process, only Python-level
writes to ``sys.stdout`` / ``sys.stderr`` from the replica's own thread are labelled with its
rank; what native code, other threads, or handlers bound to the original streams write is shown
with the ``[xla]`` label.

Where torch_xla limits the promises:

- A replica cannot be stopped alone: the first failure stops the whole process group (SIGTERM,
  then SIGKILL), which is what torch_xla does too.
- When a replica process dies in native code (an XLA abort, an OOM kill), torch_xla only
  reports a broken process pool, so every rank that had not reported is named, not the one
  process that died; its Python stacks (``faulthandler``) are in the ``[xla]`` or rank output.
- Replica processes are torch_xla's, not ours: they are tied to the host (they die with it),
  the host dies with the caller, and the host's process group is killed when the launch ends,
  so none outlives it, unless a replica starts its own session (``setsid``).
- Only fork: the notebook must not have initialized the XLA runtime (it then holds the TPU and
  no replica could use it); restarting the kernel is the only fix. Spawn is refused.
- ``num_processes`` is 1 or every device the runtime reports (torch_xla's rule); another count
  runs every device, with a note (any count works on the CPU runtime).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import io
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from nbaccel.environment import DistributedEnv, WorkerSettings, apply_environment, worker_environment
from nbaccel.errors import PayloadPicklingError
from nbaccel.launch.events import LaunchObserver, RankState
from nbaccel.launch.failures import WorkerFailure, raise_failures
from nbaccel.launch.frames import write_frame
from nbaccel.launch.output import OutputRelay, Stream
from nbaccel.launch.payload import dumps_result, loads
from nbaccel.launch.supervisor import Supervisor, WorkerHandle
from nbaccel.launch.worker import WorkerSpec, _report_error, die_with_parent, run_worker

__all__ = ["HOST_RANK", "ReplicaInfo", "current_replica", "launch_xla"]

HOST_RANK = -1
"""The pseudo-rank of the torch_xla host process in output labels and failure reports."""

# --------------------------------------------------------------------------- replica side


@dataclass(frozen=True)
class ReplicaInfo:
    """Who the calling replica thread is, as the XLA launcher set it up.

    Attributes:
        rank: the replica's global ordinal.
        world_size: replicas in the launch.
        shares_process: other replicas run as threads of the same process (TPU v2/v3, the CPU runtime).
    """

    rank: int
    world_size: int
    shares_process: bool


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


def current_replica() -> ReplicaInfo | None:
    """The calling thread's replica, inside a function started by :func:`launch_xla`; else ``None``.

    Example:
        >>> current_replica() is None  # outside a launch
        True
    """
    return getattr(_local, "info", None)


class _RoutedStream(io.TextIOBase):
    """``sys.stdout``/``sys.stderr`` of a process with several replica threads: each writes to its own pipe."""

    def __init__(self, name: Stream, fallback: TextIO) -> None:
        self._name = name
        self._fallback = fallback

    def _target(self) -> TextIO:
        streams = getattr(_local, "streams", None)
        return streams[self._name] if streams else self._fallback

    def write(self, text: str) -> int:  # type: ignore[override]
        return self._target().write(text)

    def flush(self) -> None:
        self._target().flush()

    def fileno(self) -> int:
        return self._target().fileno()

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:  # type: ignore[override]
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
                sys.stdout = _RoutedStream("stdout", sys.stdout)  # type: ignore[assignment]
                sys.stderr = _RoutedStream("stderr", sys.stderr)  # type: ignore[assignment]
                faulthandler.enable(all_threads=True)  # native crashes: every thread's stack, [xla]-labelled
        return shared


def _enter_replica(job: _ReplicaJob, rank: int) -> None:
    shared = _setup_process_once(job)
    _, out_fd, err_fd = job.pipes[rank]
    if shared:
        _local.streams = {"stdout": _line_stream(out_fd), "stderr": _line_stream(err_fd)}
    else:  # the only replica here: the whole process's output is this rank's
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        sys.stdout = sys.__stdout__ = _line_stream(1)
        sys.stderr = sys.__stderr__ = _line_stream(2)
        faulthandler.enable(all_threads=True)
        if job.world_size > 1:  # one process per replica (TPU v4 and later): torchrun's variables work
            import torch_xla.runtime as xr

            dist = DistributedEnv(rank=rank, local_rank=xr.local_ordinal(), world_size=job.world_size,
                                  local_world_size=xr.local_device_count(), node_rank=0,
                                  master_addr="127.0.0.1", master_port=0)
            apply_environment(worker_environment(job.settings, dist))
    _local.info = ReplicaInfo(rank=rank, world_size=job.world_size, shares_process=shared)


def _leave_replica() -> None:
    for stream in getattr(_local, "streams", {}).values():
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    _local.streams = None
    _local.info = None
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _replica_main(index: int) -> None:
    """What ``torch_xla.launch`` runs in every replica: run the function, report on this rank's pipe."""
    job = _JOB
    assert job is not None, "nbaccel's XLA replica entry ran outside launch_xla"
    ctl_fd = job.pipes[index][0]
    spec = WorkerSpec(rank=index, env={}, ctl_fd=ctl_fd, parent_pid=job.host_pid)
    try:
        _enter_replica(job, index)
        write_frame(ctl_fd, "started", {"pid": os.getpid(), "time": time.time()})
        try:
            result = job.function(*job.args, **job.kwargs)
        except SystemExit as stop:
            if stop.code not in (None, 0):
                raise
            result = None
        try:
            payload = dumps_result(result)
        except Exception as exc:  # noqa: BLE001
            raise PayloadPicklingError(
                f"rank {index} returned a {type(result).__qualname__} that cannot be pickled back to the "
                f"caller: {exc}. Fix: return plain data (tensors, numbers, dicts, state_dict()).",
                object_path="return value", object_type=type(result).__qualname__) from exc
        write_frame(ctl_fd, "result", payload)
    except BaseException as exc:  # noqa: BLE001 - reported; the supervisor then stops the whole launch
        try:
            _report_error(spec, exc)
        except BaseException:  # noqa: BLE001 - the missing report still tells the supervisor
            pass
    finally:
        _leave_replica()


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

    def poll(self) -> bool:
        if self.exited:
            return True
        if self.result is not None or self.error is not None or self._host_gone():
            self.exited = True
        return self.exited

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


class _XlaRelay(OutputRelay):
    """Labels the host process's own output ``[xla]`` and always shows it."""

    def _label(self, rank: int) -> str:
        return "[xla]: " if rank == HOST_RANK else super()._label(rank)

    def _visible(self, rank: int) -> bool:
        return rank == HOST_RANK or super()._visible(rank)


class _XlaSupervisor(Supervisor):
    """The supervisor, with one host handle (first) and one handle per replica."""

    def __init__(self, host: _HostHandle, replicas: Sequence[_ReplicaHandle], relay: OutputRelay,
                 observer: LaunchObserver | None, **kwargs: Any) -> None:
        super().__init__([host, *replicas], relay, observer, **kwargs)
        self.host = host
        self.replicas = list(replicas)
        self._host_failure: WorkerFailure | None = None

    def run(self) -> dict[int, Any]:
        """As :meth:`Supervisor.run`, counting and reporting only the replicas (not the host)."""
        try:
            failures = self._watch(time.monotonic())
        except BaseException:
            self._stop_all(interrupted=True)
            raise
        finally:
            self._kill_remaining()
            self._close()
        if failures:
            raise_failures(failures, len(self.replicas), [r for r in self._stopped if r != HOST_RANK])
        return {h.rank: loads(h.result) for h in self.replicas if h.result is not None}

    def _set_state(self, handle: WorkerHandle, state: RankState) -> None:
        if handle is self.host:
            handle.state = state
        else:
            super()._set_state(handle, state)

    def _on_message(self, handle: WorkerHandle, kind: str, body: Any) -> None:
        if kind == "started" and handle is not self.host:
            handle.pid = body["pid"]  # the replica's own process (signals still go to the host's group)
        super()._on_message(handle, kind, body)

    def _on_exit(self, handle: WorkerHandle) -> WorkerFailure | None:
        if handle is self.host:
            return self._on_host_exit()
        self._drain(handle)  # a report may still be in the pipe
        if handle.result is None and handle.error is None and handle.rank not in self._stopped:
            return self._unreported(handle)
        failure = super()._on_exit(handle)
        if all(r.exited for r in self.replicas) and not self.host.exited:
            self.host.result_at = time.monotonic()  # every rank is done: the host gets a grace to tear down
        return failure

    def _on_host_exit(self) -> WorkerFailure | None:
        failure = super()._on_exit(self.host)
        for replica in self.replicas:
            if not replica.exited:
                self._drain(replica)  # frames still in a pipe decide whether the rank reported
        if failure is None or any(r.state != "starting" for r in self.replicas):
            self._host_failure = failure
            return None  # the replicas' own reports (or their absence) say what went wrong
        message = f"torch_xla.launch failed in the host process before any replica started: {failure.message}"
        return dataclasses.replace(failure, message=message)

    def _unreported(self, handle: WorkerHandle) -> WorkerFailure | None:
        if handle.state == "starting":
            self._set_state(handle, "stopped")
            return None
        self._set_state(handle, "failed")
        host = self._host_failure
        said = ""
        if host is not None and host.exc_type:
            said = f" torch_xla reported: {host.exc_type}: {host.message.strip().splitlines()[-1]}"
        in_host = handle.pid == self.host.pid  # one replica, run inside the host: its exit is the host's
        return WorkerFailure(
            rank=handle.rank, pid=handle.pid, time=host.time if host is not None else time.time(),
            exitcode=self.host.exitcode if in_host else None, signal=self.host.signal if in_host else None,
            message="its replica process ended without reporting an exception (a crash in native code such as "
                    "an XLA abort, an OOM kill, or os._exit); look for a faulthandler stack in the output "
                    f"above.{said}")

    def _check_deadlines(self, now: float, started: float) -> None:
        # The host is not a rank: the hang watchdog counts and names the replicas only.
        workers, self.workers = self.workers, list(self.replicas)
        try:
            super()._check_deadlines(now, started)
        finally:
            self.workers = workers

    def dump_stacks(self, wait: float = 1.0) -> dict[int, str]:
        running = [h for h in self.replicas if not h.exited and h.state == "running"]
        self.relay.capturing = {h.rank for h in running} | {HOST_RANK}
        self.host.send(signal.SIGUSR1)  # every process of the group dumps all its threads
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            self._pump(0.05)
        self.relay.capturing = set()
        shared = "\n".join(self.relay.captured.pop(HOST_RANK, []))
        return {h.rank: "\n".join(self.relay.captured.pop(h.rank, [])) or shared for h in running}


def _start_host(function: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], n: int,
                settings: WorkerSettings, env: Mapping[str, str]) -> tuple[_HostHandle, list[_ReplicaHandle]]:
    """Fork the host process (its own process group) with a control/stdout/stderr pipe per rank."""
    host_pipes = [os.pipe() for _ in range(3)]
    rank_pipes = [[os.pipe() for _ in range(3)] for _ in range(n)]
    read_ends = [r for r, _ in host_pipes] + [r for trio in rank_pipes for r, _ in trio]
    parent = os.getpid()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork with threads
        pid = os.fork()
    if pid == 0:  # the host; never returns
        try:
            os.setpgid(0, 0)  # Jupyter's interrupt (sent to the kernel's group) reaches only the caller
            job = _ReplicaJob(function=function, args=tuple(args), kwargs=dict(kwargs), world_size=n,
                              pipes=tuple(tuple(w for _, w in trio) for trio in rank_pipes),  # type: ignore[misc]
                              host_pid=os.getpid(), settings=settings)
            spec = WorkerSpec(rank=HOST_RANK, env=env, ctl_fd=host_pipes[0][1], parent_pid=parent,
                              out_fd=host_pipes[1][1], err_fd=host_pipes[2][1], close_fds=read_ends)
        except BaseException:  # noqa: BLE001
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


def launch_xla(function: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], plan: Any, *,
               output_ranks: Iterable[int] | int | None = None, return_all: bool = False,
               timeout: float | None = None, observer: LaunchObserver | None = None,
               hang_timeout: float | None = 120.0) -> Any:
    """Run ``function`` on every XLA device through ``torch_xla.launch`` and bring its results back.

    Called by :func:`~nbaccel.launch.launcher.notebook_launcher` when the plan's device kind is
    ``"xla"``; ``plan.num_processes`` is 1 or the number of devices the runtime reports.

    Returns:
        Rank 0's return value (moved to CPU), or ``{rank: value}`` when ``return_all``.

    Raises:
        ConfigError: ``output_ranks`` names a rank that does not exist.
        LaunchTimeoutError: ``timeout`` passed or the hang watchdog fired.
        KeyboardInterrupt: the caller was interrupted; the host and every replica were stopped.
        BaseException: the root-cause replica's own exception, with ``launch_failures`` attached.

    Example:
        >>> def where():
        ...     import torch_xla.runtime as xr
        ...     return xr.global_ordinal()
        >>> launch_xla(where, (), {}, plan_launch(LaunchConfig(distributed_type="XLA")))  # doctest: +SKIP
        0
    """
    from nbaccel.launch.launcher import _check_ranks

    n = plan.num_processes
    shown = _check_ranks(output_ranks, n)
    import torch_xla  # noqa: F401 - imported once here (about 5 s), not in every host process

    settings: WorkerSettings = plan.settings
    env = worker_environment(settings, threads=plan.threads)
    relay = _XlaRelay(show=shown, on_line=_without_host(observer.on_output) if observer is not None else None)
    if observer is not None:
        observer.on_launch(list(range(n)), "fork")
    host, replicas = _start_host(function, args, kwargs, n, settings, env)
    supervisor = _XlaSupervisor(host, replicas, relay, observer, timeout=timeout, hang_timeout=hang_timeout)
    ok = False
    try:
        results = supervisor.run()
        ok = True
    finally:
        _kill_group(host.pid)
        if observer is not None:
            observer.on_end(ok)
    return results if return_all else results.get(0)


def _without_host(on_output: Callable[[int, Stream, str], None]) -> Callable[[int, Stream, str], None]:
    def forward(rank: int, stream: Stream, line: str) -> None:
        if rank != HOST_RANK:
            on_output(rank, stream, line)
    return forward


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
    while _group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.01)


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``, read from ``/proc``."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry))
    return members
