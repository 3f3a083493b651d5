"""What a rank does around the functions it runs: start afresh, and (a warm rank) join its group once.

A :class:`RankLifecycle` travels with the request (``LaunchRequest.lifecycle``) to every rank side: a
fresh worker and an elastic worker start afresh before the function; a pool's warm rank and a Ray
actor join their group once, then start afresh before each task. The object is passed in, not found
in tables filled by imports, so the import graph shows everything a rank does; the process state and
the run log drop what an older rank generation left when next read (:func:`nbaccel.identity.start_afresh`).
It sits beside the identity, below ``launch/``, which carries it without knowing what it forgets.
"""

from __future__ import annotations

from nbaccel.identity import start_afresh
from nbaccel.process_group import join_warm_rank_group

__all__ = ["RankLifecycle"]


class RankLifecycle:
    """nbaccel's rank lifecycle; subclass it (calling ``super()``) to forget or set up state of your own.

    Like Accelerate's ``ModelHook``, every method has a working default, and a launch takes an
    instance through ``build_request(..., lifecycle=...)``, ``notebook_launcher(..., lifecycle=...)`` or
    ``WorkerPool(..., lifecycle=...)``. It reaches spawned workers and Ray actors pickled, so a subclass
    must be picklable (a class of a module or of the notebook, with no open handles).

    Example:
        >>> class ForgetCache(RankLifecycle):
        ...     def start_afresh(self) -> None:
        ...         super().start_afresh()
        ...         CACHE.clear()
        >>> CACHE = {"old": 1}; ForgetCache().start_afresh(); CACHE
        {}
    """

    def start_afresh(self) -> None:
        """Forget what ran in this process before: the caller's identity, process state and run log.

        Called in a fresh worker before the function, and in a warm rank before each task.
        """
        start_afresh()

    def join_group(self) -> str:
        """Join a warm rank's process group, once for its pool's life; returns the rank's device (``"cpu"``)."""
        return join_warm_rank_group()

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
