"""What a backend gives the core: its launcher and the steps only some backends have, found through the registry.

A backend subpackage defines ``BACKEND = Backend(...)`` in the module that :data:`nbaccel.launch.registry.BACKENDS`
names; the core calls a backend only through these fields (docs/architecture.md, Registry).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from nbaccel.config import LaunchConfig
from nbaccel.launch.base import LaunchRequest, Launcher
from nbaccel.launch.preflight import LaunchPlan, plan_launch

if TYPE_CHECKING:  # an annotation only: the supervision modules load with the first launch, not with nbaccel
    from nbaccel.launch.supervised_run import SupervisedRun

__all__ = ["Backend", "PoolRanks"]


class PoolRanks(Protocol):
    """What a pool holds on a backend: live ranks that run task after task."""

    @property
    def lost(self) -> str | None: ...
    def dead(self) -> str | None: ...
    def workers(self) -> list[tuple[int, int, bool, str, int | None]]: ...
    def run(self, function: Callable[..., Any], args: Any, kwargs: Mapping[str, Any], *, run: SupervisedRun,
            result_ranks: Collection[int] | None) -> dict[int, Any]: ...
    def shutdown(self) -> None: ...


@dataclass(frozen=True)
class Backend:
    """Where ranks live, as the registry knows it: the core calls a backend only through these fields.

    Attributes:
        launcher: starts and supervises one request's ranks; its ``name`` is the backend's.
        plan: turns a config into the ranks to run (Ray asks its cluster, XLA its runtime); the
            default is this machine's preflight.
        start_pool: ``start_pool(request, start_timeout)`` starts a ``WorkerPool``'s ranks;
            ``None``: this backend keeps no ranks warm.
        before_launch: called with every request before it starts, once this backend is loaded
            (the warm rank gives up a GPU another launch needs); ``None``: nothing to do.

    Example:
        >>> from nbaccel.launch.registry import backend_for
        >>> backend_for("ray").start_pool is not None, backend_for("elastic").start_pool
        (True, None)
    """

    launcher: Launcher
    plan: Callable[[LaunchConfig], LaunchPlan] = plan_launch
    start_pool: Callable[[LaunchRequest, float], PoolRanks] | None = None
    before_launch: Callable[[LaunchRequest], None] | None = None
