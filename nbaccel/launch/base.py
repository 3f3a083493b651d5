"""The `Launcher` protocol: what every way of starting workers implements.

A launcher takes a resolved :class:`~nbaccel.launch.request.LaunchRequest`, starts the workers
it describes, supervises them, and returns ``{rank: result}`` for the ranks it ran, or raises:
a member of the :class:`~nbaccel.errors.WorkerFailedError` family for failed workers (see
:mod:`nbaccel.launch.failures`), :class:`~nbaccel.errors.LaunchTimeoutError`, or the caller's
``KeyboardInterrupt`` once every worker is stopped. Nothing it started outlives the call.

Each launcher lives in its backend's subpackage, in ``nbaccel.launch.<name>.launcher``, which defines
``LAUNCHER``; :mod:`nbaccel.launch.registry` finds it by the request's ``launcher`` name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from nbaccel.launch.request import LaunchRequest

__all__ = ["Launcher"]


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
