"""One supervised run, the same for every backend and lifetime: the observer's bracket, the policy, the relay.

Entering calls ``observer.on_launch``; :meth:`SupervisedRun.supervise` runs the
:class:`~nbaccel.launch.supervisor.Supervisor` and returns its ``RunResult``; leaving calls
``observer.on_end(ok)``, also when starting failed (docs/architecture.md, the walk of a launch).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType

from nbaccel.launch.base import LaunchRequest
from nbaccel.launch.events import LaunchObserver, as_observer
from nbaccel.launch.handles import WorkerHandle
from nbaccel.launch.outcomes import RunResult
from nbaccel.launch.output import OutputRelay
from nbaccel.launch.rich_output import CellPublisher
from nbaccel.launch.supervisor import Supervisor, SupervisorPolicy

__all__ = ["Lifetime", "SupervisedRun"]


@dataclass(frozen=True)
class Lifetime:
    """How long a run's ranks live, and how the run names them.

    Attributes:
        name: what the observer hears as the start method (``"fork"``, ``"spawn"``, ``"warm"``, ``"pool"``, ``"ray"``).
        keep_alive: the ranks outlive the run (stopping them cancels their task).
        grace: seconds between asking ranks to stop and killing them.
        host_name: how reports name the process the ranks run inside, where there is one.
        labels: output labels of pseudo-ranks that are not ranks (torch_xla's host process).
    """

    name: str
    keep_alive: bool = False
    grace: float = SupervisorPolicy.grace
    host_name: str = SupervisorPolicy.host_name
    labels: Mapping[int, str] = field(default_factory=dict)


class SupervisedRun:
    """The bracket and the supervision of one run of ``request`` (see the module docstring)."""

    def __init__(self, request: LaunchRequest, lifetime: Lifetime) -> None:
        self.request = request
        self.lifetime = lifetime
        self.observer: LaunchObserver | None = as_observer(request.observer)
        self.policy = SupervisorPolicy(timeout=request.config.timeout, hang_timeout=request.hang_timeout,
                                       grace=lifetime.grace, host_name=lifetime.host_name,
                                       keep_alive=lifetime.keep_alive)

    def __enter__(self) -> SupervisedRun:
        if self.observer is not None:
            self.observer.on_launch(list(range(self.request.num_processes)), self.lifetime.name)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.observer is not None:  # also when starting failed or was interrupted
            self.observer.on_end(exc_type is None)

    def relay(self) -> OutputRelay:
        """Where the run's output goes: the cell (labelled per rank), the observer, displays of the chosen ranks."""
        observer, ranks = self.observer, self.request.output_ranks
        return OutputRelay(show=ranks, labels=self.lifetime.labels, on_display=CellPublisher(),
                           display_ranks=ranks or (0,), on_line=observer.on_output if observer else None,
                           on_progress=observer.on_progress if observer else None,
                           show_redraws=not (observer is not None and observer.shows_progress))

    def supervise(self, handles: Sequence[WorkerHandle], *, start: Callable[[], None] | None = None,
                  host: WorkerHandle | None = None) -> RunResult:
        """Watch ``handles`` to the end (see :meth:`~nbaccel.launch.supervisor.Supervisor.run`).

        Raises:
            KeyboardInterrupt: the caller was interrupted; every rank was stopped.
            LaunchTimeoutError: ``timeout`` passed or the hang watchdog fired.
            LaunchError: a rank sent ``SIGKILL`` was not reaped in time (stuck in the kernel).
        """
        return Supervisor(handles, self.relay(), self.observer, policy=self.policy, host=host).run(start)
