"""What a rank forgets before it runs someone's function, and how it joins its group: tables other pillars fill.

A fresh worker, a Ray actor becoming a rank, an elastic worker, and a warm rank between two
tasks must not see the state of whoever ran before them (the notebook's ``Accelerator``, an
earlier task's process group or trackers). The launch core does not know what that state is:
each module that keeps such state registers how to forget it when it is imported
(:func:`register_rank_reset`), and every backend calls :func:`reset_rank_state`. A module that
was never imported here has nothing to forget.

A warm rank (a pool's) joins its process group once, when the pool starts, and the group outlives
its tasks. How it joins belongs to the process state; the launch core calls :func:`join_rank_group`,
which imports :data:`GROUP_JOIN_PROVIDER` by name (a Ray actor or a spawned worker may not have
imported it yet), so this bottom module depends on nothing above it at import. Left to do: a
rank lifecycle object handed to the pool and the Ray actor instead of this name.

Example:
    >>> calls = []
    >>> register_rank_reset("example", lambda: calls.append("reset"))
    >>> reset_rank_state(); calls
    ['reset']
    >>> unregister_rank_reset("example")
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

__all__ = ["GROUP_JOIN_PROVIDER", "join_rank_group", "register_rank_reset",
           "reset_rank_state", "unregister_rank_reset"]

GROUP_JOIN_PROVIDER = "nbaccel.process_state"
"""The module whose ``join_pool_group()`` a warm rank joins its group with (nbaccel has one process state)."""

_resets: dict[str, Callable[[], None]] = {}


def register_rank_reset(name: str, reset: Callable[[], None]) -> None:
    """Call ``reset()`` whenever a rank starts afresh; ``name`` (the registering module) replaces an earlier one."""
    _resets[name] = reset


def unregister_rank_reset(name: str) -> None:
    """Forget the reset registered as ``name`` (no error when there is none)."""
    _resets.pop(name, None)


def reset_rank_state() -> None:
    """Run every registered reset, in registration order (a module registers after what it builds on)."""
    for reset in list(_resets.values()):
        reset()


def join_rank_group() -> str:
    """Join this rank's process group (once for a warm rank's life); returns the rank's device, e.g. ``"cpu"``.

    Raises:
        RuntimeError: :data:`GROUP_JOIN_PROVIDER` has no ``join_pool_group`` (a broken install).
    """
    join = getattr(importlib.import_module(GROUP_JOIN_PROVIDER), "join_pool_group", None)
    if join is None:
        msg = (f"{GROUP_JOIN_PROVIDER!r} has no join_pool_group, so a warm rank cannot join its process group. "
               "Fix: reinstall nbaccel (that module defines it)")
        raise RuntimeError(msg)
    return str(join())
