"""``%accel_workers``: start, show, restart and stop the notebook's warm pool; ``--persist`` cells run on it.

One pool per shell, held by :class:`NotebookPool`. ``%accel_workers start -n 2 --cpu`` starts it
with the same layering of settings as ``%%accel_launch`` (config file < session defaults <
flags); ``%accel_workers`` prints its ranks, pids, devices, memory and the names defined in
rank 0's namespace; ``%accel_workers stop`` closes it (so does the kernel's shutdown: the pool is
closed at interpreter exit, and its workers die with the kernel anyway).
"""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError

from nbaccel.config import LaunchConfig
from nbaccel.errors import ConfigError, EnvironmentStateError, MissingDependencyError
from nbaccel.launch.pool.worker_pool import WorkerPool
from nbaccel.launch.request import LaunchRequest

__all__ = ["NotebookPool", "defined_names", "format_status", "launch_flags_given", "persisted_launch",
           "plain_interrupt"]

# %%accel_launch flags that say how workers start: a persisted cell runs on workers started already.
_LAUNCH_FLAGS = {"num_processes": None, "mixed_precision": None, "cpu": None, "config_file": None,
                 "start_method": None, "timeout": None, "hang_timeout": 120.0, "port": None, "num_nodes": None,
                 "node_rank": None, "rdzv_endpoint": "", "backend": None, "ray_address": None, "fresh": False}

_START_HINT = "%accel_workers start -n 2   (add --cpu, --mixed_precision, ... as for %%accel_launch)"


def defined_names() -> list[str]:
    """Run in rank 0 by the status: the names a user defined in the persisted namespace."""
    import types

    from nbaccel.launch.pool.serve import worker_namespace

    return sorted(n for n, v in worker_namespace().items()
                  if not n.startswith("_") and not isinstance(v, types.ModuleType))


def _megabytes(size: int | None) -> str:
    return "?" if size is None else f"{size / 2**20:.0f} MiB"


def format_status(pool: WorkerPool | None, names: list[str] | None = None) -> str:
    """The text ``%accel_workers`` prints: one line per rank, then the defined names, then the warm one-process rank."""
    from nbaccel.launch.pool.warm import IDLE_CLOSE_SECONDS, warm_rank_info

    warm = warm_rank_info()
    warm_line = "" if warm is None else (
        f"\nnbaccel: one-process launches run on a warm rank: pid {warm.pid} ({warm.device}, {warm.start_method}), "
        f"{warm.runs} run{'s' if warm.runs != 1 else ''}, idle {warm.idle_seconds:.0f}s (closed after "
        f"{IDLE_CLOSE_SECONDS:.0f}s idle, or by %accel_workers stop; --fresh skips it)")
    if pool is None:
        return f"nbaccel: no warm workers. Start them with: {_START_HINT}{warm_line}"
    state = "alive" if pool.alive else "dead (restart it: %accel_workers restart)"
    lines = [f"nbaccel: {pool.num_processes} warm worker{'s' if pool.num_processes != 1 else ''} "
             f"({pool.start_method}), {state}",
             f"{'rank':>4}  {'pid':>8}  {'alive':5}  {'device':8}  memory"]
    for info in pool.workers():
        lines.append(f"{info.rank:>4}  {info.pid:>8}  {'yes' if info.alive else 'no':5}  {info.device:8}  "
                     f"{_megabytes(info.memory_bytes)}")
    if names is not None:
        lines.append("defined (rank 0): " + (", ".join(names) if names else "nothing yet"))
    return "\n".join(lines) + warm_line


class NotebookPool:
    """The shell's warm pool, if one was started."""

    def __init__(self) -> None:
        self.pool: WorkerPool | None = None

    def start(self, config: LaunchConfig, grace: float) -> WorkerPool:
        """Start the pool with ``config``.

        Raises:
            UsageError: a pool is running already, or a setting is invalid (nothing started).
        """
        if self.pool is not None and self.pool.alive:
            raise UsageError(f"%accel_workers start: {self.pool.num_processes} warm workers are running already. "
                             "Fix: %accel_workers restart (same settings), or %accel_workers stop first.")
        self.stop()
        try:
            self.pool = WorkerPool(config=config, grace=grace)
        except (ConfigError, EnvironmentStateError, MissingDependencyError) as exc:
            raise UsageError(f"%accel_workers start: {exc}") from None
        return self.pool

    def stop(self) -> bool:
        """Close the pool and the warm one-process rank; whether there was either."""
        from nbaccel.launch.pool.warm import close_warm_rank

        had = close_warm_rank()
        had = self.pool is not None or had
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        return had

    def required(self, command: str) -> WorkerPool:
        """The pool, for ``command``.

        Raises:
            UsageError: no pool was started.
        """
        if self.pool is None:
            raise UsageError(f"{command} needs warm workers, and none are running. Fix: start them first with "
                             f"{_START_HINT}")
        return self.pool

    def status(self) -> str:
        """The status text, with the names defined in rank 0 when the pool can answer."""
        names = None
        if self.pool is not None and self.pool.alive:
            try:
                names = self.pool.run(defined_names)
            except Exception:  # noqa: BLE001 - the table still shows what is known
                names = None
        return format_status(self.pool, names)


def launch_flags_given(args: Any) -> list[str]:
    """The ``%%accel_launch`` flags in ``args`` that only a fresh launch honours (set at ``%accel_workers start``)."""
    return [name for name, default in _LAUNCH_FLAGS.items() if getattr(args, name, default) != default]


def persisted_launch(pool: WorkerPool) -> Any:
    """A ``launch(request)`` for ``%%accel_launch``'s path that runs on ``pool``: rank 0's value, or all."""
    def launch(request: LaunchRequest) -> Any:
        results = pool.launch(request)
        return results if request.return_all else results.get(0)
    return launch


def plain_interrupt(message: str) -> KeyboardInterrupt:
    """The ``KeyboardInterrupt`` a persisted cell shows: the pool's message, no traceback."""
    exc = KeyboardInterrupt(message)
    exc._render_traceback_ = lambda: [f"KeyboardInterrupt: {message}"]  # type: ignore[attr-defined]  # IPython's hook on the exception object
    return exc
