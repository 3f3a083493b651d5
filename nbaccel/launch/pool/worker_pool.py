"""`WorkerPool`: N warm workers that stay up between runs, with their process group and their state.

A launch starts workers, runs one function and ends them. A pool starts its workers once (fork
when safe, else spawn), each joins the process group once, and then every :meth:`WorkerPool.run`
is a message to live workers: what a run leaves behind (a loaded model, an ``Accelerator``,
anything in :func:`~nbaccel.launch.pool.serve.worker_namespace`) is there for the next one. One
run at a time: a second thread's :meth:`WorkerPool.run` waits for the first to end. Where the
ranks live is the backend's (docs/architecture.md, Lifetimes: its diagram is this module's).

What always holds: after a run returns or raises, the pool is either alive with every rank
waiting, or dead with every worker gone; a dead or closed pool refuses to run
(:class:`~nbaccel.errors.WorkerPoolError`) until :meth:`WorkerPool.restart`. Nothing outlives the
pool's owner: ``close()``, garbage collection and interpreter exit shut it down; each worker dies
with the owning process (``PR_SET_PDEATHSIG``, :mod:`nbaccel.launch.owner_thread`) or when its
socket closes; and the group reaper kills what the workers started when the owner is killed.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from nbaccel.config import LaunchBackend, LaunchConfig, StartMethod
from nbaccel.environment import MixedPrecision
from nbaccel.errors import ConfigError, LaunchTimeoutError, WorkerPoolError
from nbaccel.launch.backend import PoolRanks
from nbaccel.launch.claims import cancel_holders, pool_resource, refuse_held
from nbaccel.launch.events import LaunchObserver
from nbaccel.launch.preflight import say
from nbaccel.rank_lifecycle import RankLifecycle
from nbaccel.launch.registry import backend_for, run_before_launch
from nbaccel.launch.request import LaunchRequest, build_request
from nbaccel.launch.supervised_run import Lifetime, SupervisedRun

__all__ = ["WorkerInfo", "WorkerPool"]


@dataclass(frozen=True)
class WorkerInfo:
    """One pool worker, as :meth:`WorkerPool.workers` reports it.

    Attributes:
        rank: global rank.
        pid: process id.
        alive: whether the process is running.
        device: the device it uses (``"cpu"``, ``"cuda:1"``).
        memory_bytes: its resident memory (``None`` where ``/proc`` is not available).
    """

    rank: int
    pid: int
    alive: bool
    device: str
    memory_bytes: int | None


def _start_ranks(request: LaunchRequest, start_timeout: float) -> PoolRanks:
    """The pool's ranks, started by its backend.

    Raises:
        ConfigError: the backend keeps no ranks warm (a registered launcher took the backend's name).
    """
    name = request.config.backend
    start = backend_for(name).start_pool
    if start is None:
        raise ConfigError(f"backend {name!r} keeps no ranks warm, so a WorkerPool cannot start on it. Fix: pass "
                          "backend='local' or 'ray' with nbaccel's own launchers.", key="backend", value=name,
                          valid=("local", "ray"))
    return start(request, start_timeout)


def _shutdown_if_owner(ranks: PoolRanks, owner: int) -> None:
    """Shut ``ranks`` down, in the process that started them only (a forked child's exit runs finalizers too)."""
    if os.getpid() == owner:
        ranks.shutdown()


def _pool_placeholder() -> None:
    """The function of the request a pool is planned from (each run sends its own)."""


class WorkerPool:
    """Warm workers that live across runs (and notebook cells): load a model once, use it many times.

    Takes :func:`~nbaccel.notebook_launcher`'s options and starts the workers at once. Each joins
    the process group when it starts, so ``Accelerator()`` in any run finds it, and a model
    prepared in one run is still prepared in the next. Where nbaccel differs from a launch: the
    workers leave the caller's process group, so an interrupt reaches them only through the pool,
    which cancels the running task (``KeyboardInterrupt`` in every rank) and keeps the workers.

    Args:
        num_processes: workers; ``None`` as in ``notebook_launcher`` (the GPUs, or up to 4 CPUs).
        mixed_precision: ``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"``; ``None`` takes the config's.
        use_port: the rendezvous port; ``None`` picks a free one.
        start_method: ``"fork"``, ``"spawn"`` or ``None`` (fork when safe).
        use_cpu: run on CPU processes even where GPUs exist.
        output_ranks: show only these ranks' output.
        timeout: cancel a run after this many seconds (raises ``LaunchTimeoutError``; the pool stays).
        hang_timeout: when some ranks have finished a run and the rest print nothing for this many
            seconds, dump their stacks and cancel the run, as ``notebook_launcher`` does; ``None``
            disables the watchdog.
        grace: seconds a cancelled rank has to stop before it is killed (and the pool with it).
        start_timeout: seconds the workers have to start and join the process group.
        config: a :class:`LaunchConfig` supplying every value not given here.
        backend: ``"local"`` (this machine's processes) or ``"ray"``: the workers are Ray actors
            on a Ray cluster, kept (with their process group) until the pool closes; see
            :mod:`nbaccel.launch.ray.pool`. ``None``: the config's.
        ray_address: with ``backend="ray"``, the cluster (as in ``notebook_launcher``).
        lifecycle: how each rank starts afresh and joins the pool's group (as in ``notebook_launcher``).

    Raises:
        ConfigError: an option is invalid, or asks for several machines or XLA devices.
        WorkerFailedError: a worker failed while starting (nothing is left running).
        LaunchError: the workers did not start within ``start_timeout`` (nothing is left running).

    Example:
        >>> with WorkerPool(num_processes=2, use_cpu=True) as pool:    # doctest: +SKIP
        ...     pool.run(load_model)                                   # minutes, once
        ...     pool.run(generate, "Hello")                            # seconds, many times
    """

    name = "pool"

    def __init__(self, num_processes: int | None = None, mixed_precision: MixedPrecision | None = None,
                 use_port: int | str | None = None, *, start_method: StartMethod | None = None,
                 use_cpu: bool | None = None, output_ranks: Iterable[int] | int | None = None,
                 timeout: float | None = None, hang_timeout: float | None = 120.0, grace: float = 3.0,
                 start_timeout: float = 300.0,
                 config: LaunchConfig | None = None, backend: LaunchBackend | None = None,
                 ray_address: str | None = None, lifecycle: RankLifecycle | None = None) -> None:
        for key, value, example in (("grace", grace, 3.0), ("start_timeout", start_timeout, 300.0)):
            if not (isinstance(value, (int, float)) and value > 0):
                raise ConfigError(f"{key} must be a positive number of seconds (got {value!r}). Fix: {key}={example}",
                                  key=key, value=value, valid="> 0")
        self._request = build_request(
            _pool_placeholder, config=config, output_ranks=output_ranks, use_port=use_port, launcher="pool",
            num_processes=num_processes, mixed_precision=mixed_precision, use_cpu=use_cpu,
            start_method=start_method, timeout=timeout, hang_timeout=hang_timeout, backend=backend,
            ray_address=ray_address, lifecycle=lifecycle)
        _refuse_unsupported(self._request)
        self.grace = grace
        self.start_timeout = start_timeout
        self._ranks: PoolRanks | None = None
        self._finalizer: weakref.finalize | None = None
        self._owner = os.getpid()
        self._dead: str | None = None  # why the pool cannot run (None: it can)
        self._closed = False
        self._closes = 0  # close() calls so far: a run that sees it change was ended by close(), not by a fault
        self._running = threading.Lock()  # one run at a time: replies are not tagged with their caller
        self._runner: int | None = None
        self._start()

    # ------------------------------------------------------------------ lifecycle
    def _start(self) -> None:
        say(self._request.plan.note)
        run_before_launch(self._request)  # as a launch does: a warm one-process rank gives its GPU up
        ranks = _start_ranks(self._request, self.start_timeout)
        self._ranks, self._dead, self._closed = ranks, None, False
        self._owner = os.getpid()
        self._finalizer = weakref.finalize(self, _shutdown_if_owner, ranks, self._owner)  # also at interpreter exit

    def close(self) -> None:
        """Stop every worker and free what the pool holds; safe to call again (a background run on it is cancelled).

        Example:
            >>> pool.close(); pool.close(); pool.alive                  # doctest: +SKIP
            False
        """
        cancel_holders([pool_resource(self)])  # a background run on it is cancelled first, as an interrupt would
        self._closed = True
        self._closes += 1
        if self._finalizer is not None:
            self._finalizer()  # runs ranks.shutdown once
        self._ranks = None

    def restart(self) -> None:
        """Stop the workers (alive or dead) and start fresh ones with the same options.

        Their state is gone: the next runs start from an empty namespace and a new process group.
        """
        self.close()
        self._start()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ state
    @property
    def num_processes(self) -> int:
        """The number of workers (ranks)."""
        return self._request.num_processes

    @property
    def start_method(self) -> str:
        """How the workers were started: ``"fork"``, ``"spawn"``, or ``"ray"`` (actors on a Ray cluster)."""
        return "ray" if self._request.config.backend == "ray" else self._request.plan.start_method

    @property
    def alive(self) -> bool:
        """Whether the pool can run tasks: started, not closed, no worker died, and asked from the pool's process."""
        if self._closed or self._dead or os.getpid() != self._owner:
            return False
        return self._ranks is not None and not self._ranks.dead()

    def workers(self) -> list[WorkerInfo]:
        """Each worker's rank, pid, liveness, device and resident memory (empty once closed).

        On Ray, ``pid`` is the actor's process on its node, and the memory is what the actor reports.
        """
        return [WorkerInfo(*row) for row in self._ranks.workers()] if self._ranks is not None else []

    @property
    def pids(self) -> list[int]:
        """The workers' process ids, by rank."""
        return [w.pid for w in self.workers()]

    def _usable(self) -> PoolRanks:
        if self._ranks is not None and os.getpid() != self._owner:
            raise WorkerPoolError(f"this WorkerPool belongs to process {self._owner}, which started its workers; "
                                  f"this is process {os.getpid()}, forked from it, and cannot reach them. Fix: "
                                  "create a WorkerPool in this process, or run the task from the pool's own process.",
                                  state="not owned", reason=f"owned by process {self._owner}")
        if self._closed or self._ranks is None:
            raise WorkerPoolError("this WorkerPool was closed, so it runs nothing. Fix: pool.restart() to start "
                                  "fresh workers, or create a new WorkerPool.", state="closed", reason="close()")
        self._dead = self._dead or self._ranks.dead()
        if self._dead:
            raise WorkerPoolError(f"this WorkerPool is dead: {self._dead}. Its process group is gone with it. Fix: "
                                  "pool.restart() (or %accel_workers restart), then load your state again.",
                                  state="dead", reason=self._dead)
        return self._ranks

    # ------------------------------------------------------------------ running
    def run(self, function: Callable[..., Any], *args: Any, return_all: bool = False, background: bool = False,
            **kwargs: Any) -> Any:
        """Run ``function(*args, **kwargs)`` on every worker; rank 0's value (``{rank: value}`` with ``return_all``).

        Output is shown live, labelled ``[rankN]:``; a failure raises the root-cause rank's exception
        (the :class:`~nbaccel.errors.WorkerFailedError` family) and keeps the pool; an interrupt
        cancels the run in every rank and keeps the pool. With ``background=True`` it returns a
        :class:`~nbaccel.runs.handle.LaunchRun` at once (``cancel()`` cancels the task and keeps the
        pool); the pool refuses other runs until it ends.

        Raises:
            WorkerPoolError: the pool is closed or dead (restart it).
            PayloadPicklingError: the function or an argument cannot be sent to the workers.
            WorkerFailedError: a rank raised, or a worker died (then the pool is dead).
            LaunchTimeoutError: the run passed the pool's ``timeout`` (it was cancelled).
            KeyboardInterrupt: the caller was interrupted (the run was cancelled).
            RunBusyError: a background run of this pool is running.

        Example:
            >>> pool.run(lambda: __import__("os").getpid(), return_all=True)   # doctest: +SKIP
            {0: 4711, 1: 4712}
        """
        if background:
            from nbaccel.runs.start import pool_in_background

            return pool_in_background(self, function, args, kwargs, return_all)
        results = self._dispatch(function, args, kwargs, self._request.output_ranks, None,
                                 None if return_all else {0})
        if return_all:
            return results
        return results.get(0)

    def launch(self, request: LaunchRequest) -> dict[int, Any]:
        """The :class:`~nbaccel.launch.base.Launcher` protocol: run ``request``'s function on this pool.

        Only the function, its arguments, ``output_ranks`` and ``observer`` are taken from the
        request; where and how the workers run was settled when the pool started.
        """
        ranks = request.output_ranks if request.output_ranks is not None else self._request.output_ranks
        return self._dispatch(request.function, request.args, request.kwargs, ranks, request.observer,
                              None if request.return_all else {0})

    def request(self, function: Callable[..., Any], args: Iterable[Any] = (), kwargs: Mapping[str, Any] | None = None,
                *, output_ranks: Iterable[int] | int | None = None, return_all: bool = False,
                observer: LaunchObserver | None = None) -> LaunchRequest:
        """A :class:`LaunchRequest` for :meth:`launch`: this pool's settings, with ``function`` to run.

        Raises:
            ConfigError: ``output_ranks`` names a rank the pool does not have.
        """
        ranks = None if output_ranks is None else frozenset([output_ranks] if isinstance(output_ranks, int)
                                                             else output_ranks)
        bad = sorted(r for r in ranks or () if r not in range(self.num_processes))
        if bad:
            raise ConfigError(f"output_ranks names rank {bad[0]!r}, but this pool's ranks run from 0 to "
                              f"{self.num_processes - 1}. Fix: pass ranks in that range, or None for all.",
                              key="output_ranks", value=sorted(ranks or ()), valid=list(range(self.num_processes)))
        return dataclasses.replace(self._request, function=function, args=tuple(args), kwargs=dict(kwargs or {}),
                                   output_ranks=ranks if ranks is not None else self._request.output_ranks,
                                   return_all=return_all, observer=observer)

    def _dispatch(self, function: Callable[..., Any], args: Any, kwargs: Mapping[str, Any],
                  output_ranks: Any, observer: Any, result_ranks: set[int] | None) -> dict[int, Any]:
        """One run at a time: a second caller waits here for the first run to end."""
        refuse_held([pool_resource(self)], "this WorkerPool's run")  # a background run's: refused, not waited for
        if self._runner == threading.get_ident():
            raise WorkerPoolError("this WorkerPool was asked to run a task from inside one of its own runs (an "
                                  "observer or output callback called pool.run), which would wait for itself "
                                  "forever. Fix: run the next task after pool.run returns.",
                                  state="running", reason="nested run")
        with self._running:
            self._runner = threading.get_ident()
            try:
                return self._dispatch_now(function, args, kwargs, output_ranks, observer, result_ranks)
            finally:
                self._runner = None

    def _dispatch_now(self, function: Callable[..., Any], args: Any, kwargs: Mapping[str, Any],
                      output_ranks: Any, observer: LaunchObserver | None,
                      result_ranks: set[int] | None) -> dict[int, Any]:
        ranks, closes = self._usable(), self._closes
        request = dataclasses.replace(self._request, output_ranks=output_ranks, observer=observer)
        try:
            with SupervisedRun(request, Lifetime("pool", keep_alive=True, grace=self.grace)) as run:
                return ranks.run(function, args, kwargs, run=run, result_ranks=result_ranks)
        except KeyboardInterrupt:
            raise KeyboardInterrupt(f"interrupted{self._after_failure(ranks)}") from None
        except Exception as exc:
            if self._closes != closes:  # its workers were stopped by close(): that is what to report
                raise WorkerPoolError(
                    "this run was ended by WorkerPool.close(), called while it ran (from another thread, a "
                    "callback or a finalizer): close() stopped every worker. Fix: close the pool after its runs "
                    "return; pool.restart() starts fresh workers.", state="closed", reason="close()") from exc
            if not isinstance(exc, LaunchTimeoutError):
                if ranks.lost and hasattr(exc, "add_note"):  # Python 3.11+
                    exc.add_note(f"[nbaccel] the WorkerPool is dead ({ranks.lost}); every worker was stopped. "
                                 "Fix: pool.restart() (or %accel_workers restart).")
                raise
            # The supervisor's words already say the run was cancelled; the pool adds only its own state.
            pool_state = f"The pool is dead ({ranks.lost}): restart it." if ranks.lost else "The pool is still up."
            raise LaunchTimeoutError(f"{exc}\n{pool_state}", stacks=exc.stacks, reason=exc.reason) from None
        finally:
            self._dead = self._dead or ranks.lost

    @staticmethod
    def _after_failure(ranks: PoolRanks) -> str:
        if ranks.lost:
            return f"; {ranks.lost}, so the pool is dead: restart it"
        return "; the running task was cancelled in every rank and the pool is still up"

    def __repr__(self) -> str:
        state = "alive" if self.alive else "closed" if self._closed else "dead"
        return f"WorkerPool(num_processes={self.num_processes}, start_method={self.start_method!r}, {state})"


def _refuse_unsupported(request: LaunchRequest) -> None:
    if request.config.num_machines > 1:
        raise ConfigError(f"a WorkerPool runs on one machine (got num_machines={request.config.num_machines}). Fix: "
                          "leave num_machines at 1, or use notebook_launcher for multi-machine launches.",
                          key="num_machines", value=request.config.num_machines, valid=1)
    if request.plan.device_kind == "xla":
        raise ConfigError("a WorkerPool cannot keep XLA workers: torch_xla starts and ends its replicas itself. Fix: "
                          "use notebook_launcher (or %%accel_launch without --persist) on TPUs, or pass use_cpu=True.",
                          key="distributed_type", value="XLA", valid=("MULTI_CPU", "MULTI_GPU", "NO"))
