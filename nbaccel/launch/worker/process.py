"""The worker side of a launch: one body for every worker (identity -> run -> report), and the process around it.

:func:`run_body` is what every rank runs, whichever launcher started it: it records the rank's
:class:`~nbaccel.identity.WorkerIdentity`, reports ``started``, runs the function, and reports
``result`` or ``error`` on the rank's control pipe. A local worker process (:func:`run_worker`)
and an XLA replica thread (:mod:`nbaccel.launch.xla.launcher`) differ only in what they set up around it.

:func:`run_worker` is a fresh worker process: a forked worker calls it straight after ``fork``;
a spawned one reaches it through :mod:`nbaccel.launch.worker.trampoline`. The worker dies with its
parent (``PR_SET_PDEATHSIG``), writes fd 1 and 2 into the supervisor's pipes, and leaves with
``os._exit`` so no handler of the parent (a Jupyter kernel's, say) runs in it. Before it leaves
(also when stopped with ``SIGTERM``) it ends every process it started, daemons included
(:mod:`nbaccel.launch.worker.descendants`).
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import io
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from nbaccel.environment import apply_worker_environment, read_distributed_env
from nbaccel.errors import PayloadPicklingError
from nbaccel.identity import WorkerIdentity, set_identity
from nbaccel.launch.frames import write_frame
from nbaccel.launch.failures import MESSAGE_LIMIT, TRACEBACK_LIMIT, shorten
from nbaccel.launch.payload import dumps_result
from nbaccel.launch.rank_exceptions import pack_exception
from nbaccel.rank_lifecycle import RankLifecycle
from nbaccel.launch.worker.channel import close_channel, open_channel
from nbaccel.launch.worker.console_tqdm import use_console_tqdm
from nbaccel.launch.worker.descendants import (
    become_subreaper,
    end_descendants,
    end_descendants_on_sigterm,
)
from nbaccel.launch.worker.display import (
    forward_displays,
    route_figures,
    show_open_figures,
)
from nbaccel.launch.worker.kernel_cutoff import detach_from_kernel

__all__ = ["FINISHED_WITHOUT_VALUE", "WorkerSpec", "describe_error", "die_with_parent", "report_error", "run_body",
           "run_worker"]

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class WorkerSpec:
    """What one worker needs to know about itself.

    Attributes:
        rank: global rank.
        env: environment variables to set before the function runs.
        ctl_fd: write end of the control pipe (messages to the supervisor).
        out_fd: write end of the stdout pipe (``None``: already fd 1, as under spawn).
        err_fd: write end of the stderr pipe (``None``: already fd 2).
        parent_pid: the supervisor's pid; the worker stops if it is gone.
        close_fds: inherited descriptors that belong to other workers or the parent.
        send_result: whether the caller asked for this rank's return value; when not, it is never
            pickled or sent (only that the rank finished).
        lifecycle: the launch's rank lifecycle; the worker starts afresh through it before the function.
    """

    rank: int
    env: Mapping[str, str]
    ctl_fd: int
    parent_pid: int
    out_fd: int | None = None
    err_fd: int | None = None
    close_fds: Sequence[int] = field(default_factory=tuple)
    send_result: bool = True
    lifecycle: RankLifecycle = field(default_factory=RankLifecycle)


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies; exit now if it already has."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # pragma: no cover - exotic libc
            pass
    if os.getppid() != parent_pid:
        os._exit(1)


def _setup_process(spec: WorkerSpec) -> None:
    die_with_parent(spec.parent_pid)
    become_subreaper()  # orphaned daemons it starts become its children, ended with it
    for fd in spec.close_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    if spec.out_fd is not None:
        os.dup2(spec.out_fd, 1)
        os.close(spec.out_fd)
    if spec.err_fd is not None:
        os.dup2(spec.err_fd, 2)
        os.close(spec.err_fd)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True)
    vars(sys).update(__stdout__=sys.stdout, __stderr__=sys.stderr)  # the originals too (Final in typeshed only)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    end_descendants_on_sigterm()  # how the launch stops a rank: its daemons go with it
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)
    apply_worker_environment(spec.env)  # a nested launch's worker never joins the outer job
    _forget_inherited_groups()
    detach_from_kernel()  # a forked kernel's sockets are the kernel's alone
    forward_displays(spec.ctl_fd, spec.rank)
    route_figures(os.environ)
    torch = sys.modules.get("torch")
    if torch is not None and "OMP_NUM_THREADS" in spec.env:  # the forked pool keeps the parent's size
        torch.set_num_threads(int(spec.env["OMP_NUM_THREADS"]))
    # The state the caller's modules keep (its Accelerator, ...) and the caller's identity (a notebook's,
    # or a launcher's own worker's) are not this worker's.
    spec.lifecycle.start_afresh()
    use_console_tqdm()  # a tqdm widget made here could not reach the frontend; text bars reach the panel


_INHERITED_GROUPS: list[Any] = []
"""Process groups a forked worker inherited from its launcher (a rank of an outer job): kept, never used."""


def _forget_inherited_groups() -> None:
    """Make a worker forked from a rank of an outer job start outside that job's process groups.

    The groups belong to the outer job: destroying them here would shut sockets the launcher still
    uses (and wait on threads a fork does not copy), so they are only forgotten, kept referenced so
    that no destructor runs, and torch's table is emptied so the worker can join its own group.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    c10d = dist.distributed_c10d
    world = c10d._world
    _INHERITED_GROUPS.extend([world.default_pg, *world.pg_map])
    c10d._update_default_pg(None)
    for name in ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag", "tags_to_pg",
                 "pg_coalesce_state", "comms"):  # what destroy_process_group empties (some only in newer torch)
        table = getattr(world, name, None)
        if table is not None:
            table.clear()
    unregister = getattr(c10d, "_unregister_all_process_groups", None)
    if unregister is not None:
        unregister()
    world.group_count = 0


FINISHED_WITHOUT_VALUE = b""
"""The ``result`` frame of a rank whose return value the caller did not ask for."""

_BAD_FORK = "Cannot re-initialize CUDA in forked subprocess"
_BAD_FORK_NOTE = ("nbaccel: this worker was forked from a process where CUDA was already in use in a way the "
                  "fork check could not see (a library calling the CUDA driver directly, for example). Fix: "
                  "pass start_method='spawn', or restart the kernel and launch before anything touches CUDA.")


def describe_error(exc: BaseException) -> dict[str, Any]:
    """What a worker reports about ``exc``: time, type, message, traceback, and ``exc`` pickled when it can travel.

    Where ``exc`` cannot be sent whole, its parts go (:mod:`nbaccel.launch.rank_exceptions`), else
    ``exception_note`` says why not.
    """
    try:
        message = str(exc)
    except Exception as str_error:  # noqa: BLE001 - a broken __str__ must not hide the exception
        message = f"<str() of this {type(exc).__name__} raised {type(str_error).__name__}: {str_error}>"
    if _BAD_FORK in message and hasattr(exc, "add_note") and _BAD_FORK_NOTE not in getattr(exc, "__notes__", ()):
        exc.add_note(_BAD_FORK_NOTE)  # the last resort when the preflight's probe fork saw nothing
    pickled, note = pack_exception(exc)
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {
        "time": time.time(),
        "exc_type": f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
        # A huge message travels whole once, inside the exception; the report quotes it cut.
        "message": shorten(message, MESSAGE_LIMIT),
        "traceback": shorten(text, TRACEBACK_LIMIT),
        "exception": pickled,
        "exception_note": note,
    }


def report_error(ctl_fd: int, exc: BaseException) -> None:
    """Send ``exc`` (pickled when it can travel, with its traceback text) as an ``error`` frame."""
    write_frame(ctl_fd, "error", describe_error(exc))


def _teardown() -> None:
    """Leave the process group, where leaving matters: when device work may still be in flight."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    if _host_only(dist):
        # Every collective ran on this process's CPU threads and returned: the exit that follows
        # closes the group's sockets as destroying it would. Destroying it costs 20-50 ms per worker
        # here (gloo waits out a 10 ms tick of its event loop for each peer's connection), and a
        # launch returns only when its last worker has gone.
        return
    gc.collect()  # live DDP modules first: destroying gloo under them can deadlock
    dist.destroy_process_group()


def _host_only(dist: Any) -> bool:
    """Whether every group is gloo's and no device runtime started (no collective can be running on a device)."""
    if "torch_xla" in sys.modules:  # XLA runs its work lazily: some may still be queued
        return False
    torch = sys.modules["torch"]
    for device in ("cuda", "xpu"):
        started = getattr(getattr(torch, device, None), "is_initialized", None)
        if started is not None and started():
            return False
    try:
        groups = list(dist.distributed_c10d._world.pg_map)
        return all(dist.get_backend(group) == "gloo" for group in groups)
    except Exception:  # noqa: BLE001 - torch's private table moved: leave the group the long way
        return False


def run_body(ctl_fd: int, rank: int, identity: WorkerIdentity | None, function: Callable[..., Any],
             args: Sequence[Any], kwargs: Mapping[str, Any], *, per_thread: bool = False,
             send_result: bool = True) -> BaseException | None:
    """Be rank ``rank``: record its identity, run ``function``, report the result or the error.

    Args:
        ctl_fd: the rank's control pipe to the supervisor.
        rank: its global rank (for messages).
        identity: who it is (``None``: a lone worker outside any process group).
        function: what it runs, with ``args`` and ``kwargs``.
        per_thread: the identity is the calling thread's only (replica threads sharing a process).
        send_result: report the return value itself (else only that the rank finished: an empty
            ``result`` frame, and the value is never pickled).

    Returns:
        ``None`` when the result was reported, else the exception that was reported instead.
    """
    set_identity(identity, thread=per_thread)
    try:
        write_frame(ctl_fd, "started", {"pid": os.getpid(), "time": time.time()})
        open_channel(ctl_fd, thread=per_thread)  # what the function sends while it runs ("log" frames)
        try:
            result = function(*args, **kwargs)
        except SystemExit as stop:
            if stop.code not in (None, 0):
                raise
            result = None
        finally:
            close_channel(thread=per_thread)
        if not send_result:
            write_frame(ctl_fd, "result", FINISHED_WITHOUT_VALUE)
            return None
        try:
            payload = dumps_result(result)
        except Exception as exc:
            raise PayloadPicklingError(
                f"rank {rank} returned a {type(result).__qualname__} that cannot be pickled back to "
                f"the caller: {exc}. Fix: return plain data (tensors, numbers, dicts, state_dict()).",
                object_path="return value", object_type=type(result).__qualname__) from exc
        write_frame(ctl_fd, "result", payload)
        return None
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the supervisor
        try:
            report_error(ctl_fd, exc)
        except BaseException:  # noqa: BLE001 - the exit code / missing report still tells the supervisor
            pass
        return exc
    finally:
        if per_thread:
            set_identity(None, thread=True)


def _exit_code(failed: BaseException) -> int:
    """The code a worker exits with after ``failed``: a ``sys.exit(3)`` in the function exits with 3, as the
    script would (``nbaccel launch`` passes it on); an interrupt with 130; anything else with 1."""
    if isinstance(failed, SystemExit) and isinstance(failed.code, int) and 0 < failed.code < 256:
        return failed.code
    return 130 if isinstance(failed, KeyboardInterrupt) else 1


def run_worker(spec: WorkerSpec, function: Callable[..., Any], args: Sequence[Any],
               kwargs: Mapping[str, Any]) -> NoReturn:
    """Run ``function(*args, **kwargs)`` as worker ``spec.rank`` and exit the process."""
    code = 0
    try:
        try:
            _setup_process(spec)
        except BaseException as exc:  # reported like a failure of the function
            report_error(spec.ctl_fd, exc)
            raise
        dist = read_distributed_env()  # what the launcher exported for this rank (torchrun's variables)
        identity = WorkerIdentity.from_distributed_env(dist) if dist is not None else None
        failed = run_body(spec.ctl_fd, spec.rank, identity, function, args, kwargs, send_result=spec.send_result)
        if failed is not None:
            code = _exit_code(failed)
        else:
            show_open_figures()  # as the inline backend does when a cell ends
            _teardown()
    except BaseException as exc:  # noqa: BLE001 - the exit code tells the supervisor
        code = 130 if isinstance(exc, KeyboardInterrupt) else 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            end_descendants()
        finally:
            os._exit(code)
