"""The contract between the core and a backend: the `LaunchRequest` it gets, the `Launcher` it is.

A launcher takes a resolved :class:`LaunchRequest` (built by
:func:`~nbaccel.launch.request.build_request`), starts and supervises its workers, and returns
``{rank: result}`` for the ranks it ran, or raises the :class:`~nbaccel.errors.WorkerFailedError`
family (:mod:`nbaccel.launch.failures`), :class:`~nbaccel.errors.LaunchTimeoutError`, or the
caller's ``KeyboardInterrupt`` once every worker is stopped. Nothing it started outlives the call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from nbaccel.config import LaunchConfig, RdzvBackend
from nbaccel.launch.events import LaunchObserver
from nbaccel.launch.preflight import LaunchPlan
from nbaccel.rank_lifecycle import RankLifecycle

__all__ = ["LaunchRequest", "Launcher", "Rendezvous"]


@dataclass(frozen=True)
class Rendezvous:
    """How the machines of a multi-machine launch meet (torch elastic's settings).

    Attributes:
        backend: ``"static"`` or ``"c10d"``.
        endpoint: ``host:port`` of the rendezvous.
        conf: extra rendezvous settings.
        run_id: the job id shared by all machines.
        max_restarts: restarts the elastic agent may make.
        monitor_interval: seconds between the agent's checks.
        log_line_prefix_template: the agent's output prefix (``None``: ``[rank${rank}]: ``).
    """

    backend: RdzvBackend
    endpoint: str
    conf: Mapping[str, Any] = field(default_factory=dict)
    run_id: str = "none"
    max_restarts: int = 0
    monitor_interval: float = 0.1
    log_line_prefix_template: str | None = None


@dataclass(frozen=True)
class LaunchRequest:
    """One launch: what to run, where, and how to report; immutable once built.

    Attributes:
        function: what every worker runs.
        args: its positional arguments.
        kwargs: its keyword arguments.
        config: the resolved settings (every layer applied).
        plan: this machine's concrete choices (device kind, workers, start method, settings).
        launcher: the name of the launcher module that runs it (``"local"``, ``"xla"``, ``"elastic"``).
        hang_timeout: seconds of silence, after some ranks finished, before the rest are stopped.
        output_ranks: the ranks whose output and displays are shown (``None``: every rank's
            output, rank 0's displays).
        return_all: return ``{rank: value}`` instead of rank 0's value.
        observer: receives per-rank state and output events.
        rendezvous: how machines meet (multi-machine launches only).
        warm_imports: import what DDP needs in the caller before forking (``None``: guess from
            the function; see :mod:`nbaccel.launch.warmup`).
        lifecycle: what every rank does around the function (start afresh; a warm rank's group join).
    """

    function: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    config: LaunchConfig
    plan: LaunchPlan
    launcher: str
    hang_timeout: float | None = 120.0
    output_ranks: frozenset[int] | None = None
    return_all: bool = False
    observer: LaunchObserver | None = None
    rendezvous: Rendezvous | None = None
    warm_imports: bool | None = None
    lifecycle: RankLifecycle = field(default_factory=RankLifecycle)

    @property
    def num_processes(self) -> int:
        """Workers on this machine."""
        return self.plan.num_processes

    def with_observer(self, observer: LaunchObserver | None) -> LaunchRequest:
        """A copy reporting to ``observer``."""
        return dataclasses.replace(self, observer=observer)


@runtime_checkable
class Launcher(Protocol):
    """Starts, supervises and collects the workers of one request.

    Example:
        >>> class InProcess:  # a launcher that runs the function here, as rank 0 of 1
        ...     name = "inprocess"
        ...     def launch(self, request):
        ...         return {0: request.function(*request.args, **request.kwargs)}
        >>> isinstance(InProcess(), Launcher)
        True
    """

    name: str

    def launch(self, request: LaunchRequest) -> dict[int, Any]:
        """Run ``request`` to the end; ``{rank: result}`` of the ranks run here, or raise the failure."""
        ...
