"""The front doors' side of runs: a request launched in the background, or a blocking one recorded.

``notebook_launcher(..., background=True)``, ``WorkerPool.run(..., background=True)`` and
``%%accel_launch --background`` call :func:`launch_in_background` with the request they built
(validated on the caller's thread, so a bad argument raises there and nothing starts) and the
blocking launch they would have made; ``%%accel_launch`` without it calls :func:`launch_recorded`,
so its run can be shown again by ``%accel_runs show``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any

from nbaccel.errors import ConfigError
from nbaccel.launch.claims import needed_by, pool_resource
from nbaccel.launch.request import LaunchRequest
from nbaccel.runs.handle import LaunchRun, run_blocking, start_run
from nbaccel.runs.record import RunRecord

__all__ = ["cell_label", "launch_in_background", "launch_recorded", "pool_in_background"]


def cell_label(default: str) -> str:
    """``"In[7]"`` for the notebook cell executing now, else ``default`` (a function's name)."""
    shell_module = sys.modules.get("IPython.core.interactiveshell")
    if shell_module is None or not shell_module.InteractiveShell.initialized():
        return default
    shell = shell_module.InteractiveShell.instance()
    running = getattr(shell.displayhook, "exec_result", None)  # this cell's In[N], however counted
    number = getattr(running, "execution_count", None)
    return f"In[{number}]" if number else default  # a shell that runs no cell now (a script, a test)


def _title(kind: str, n: int, cell: str) -> str:
    return f"{kind} · {cell} · {n} process{'es' if n != 1 else ''}"


def launch_in_background(request: LaunchRequest, launch: Callable[[LaunchRequest], Any], *, cell: str,
                         kind: str = "background run", resources: Iterable[str] = ()) -> LaunchRun:
    """Start ``launch(request)`` on a thread of its own, reporting to a new record; its handle at once.

    ``request``'s own observer, if any, gets every event too (from the run's thread).

    Raises:
        ConfigError: ``request`` runs on several machines (torch's elastic agent owns those ranks).
        RunBusyError: another background run holds the GPUs, warm rank or pool this one needs.
    """
    if request.rendezvous is not None:
        raise ConfigError(f"background=True runs ranks of this machine only (got num_machines="
                          f"{request.config.num_machines}). Valid: num_machines=1. Fix: drop background=True "
                          "for a multi-machine launch, or launch on one machine.", key="background", value=True,
                          valid="num_machines=1")
    record = RunRecord(request.num_processes, _title(kind, request.num_processes, cell), inner=request.observer)
    return start_run(lambda: launch(request.with_observer(record)), record, cell=cell,
                     resources={*needed_by(request), *resources})


def pool_in_background(pool: Any, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                       return_all: bool) -> LaunchRun:
    """``pool.run(function, *args, **kwargs)`` in the background; the run holds the pool until it ends.

    Raises:
        RunBusyError: another background run holds the pool.
    """
    request = pool.request(function, args, kwargs, return_all=return_all)

    def run(request: LaunchRequest) -> Any:
        results = pool.launch(request)
        return results if return_all else results.get(0)

    return launch_in_background(request, run, cell=cell_label(getattr(function, "__name__", "WorkerPool.run")),
                                kind="pool run", resources=[pool_resource(pool)])


def launch_recorded(request: LaunchRequest, launch: Callable[[LaunchRequest], Any], *, cell: str) -> Any:
    """``launch(request)`` here and now, recorded as one of the kernel's runs (its value is not kept)."""
    if request.rendezvous is not None:  # torch's elastic agent takes no observer
        return launch(request)
    record = RunRecord(request.num_processes, _title("run", request.num_processes, cell), inner=request.observer)
    return run_blocking(lambda: launch(request.with_observer(record)), record, cell=cell)
