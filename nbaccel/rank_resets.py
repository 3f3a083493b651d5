"""What a rank forgets before it runs someone's function, and how it joins its group: tables other pillars fill.

A fresh worker, a Ray actor becoming a rank, an elastic worker, and a warm rank between two
tasks must not see the state of whoever ran before them (the notebook's ``Accelerator``, an
earlier task's process group or trackers). The launch core does not know what that state is:
each module that keeps such state registers how to forget it when it is imported
(:func:`register_rank_reset`), and every backend calls :func:`reset_rank_state`. A module that
was never imported here has nothing to forget.

A warm rank (a pool's) joins its process group once, when the pool starts, and the group outlives
its tasks. How it joins belongs to the process state, which registers it
(:func:`register_group_join`); the launch core calls :func:`join_rank_group`. In a rank where
nothing imported the process state yet (a Ray actor, a spawned worker), :func:`join_rank_group`
imports :data:`GROUP_JOIN_PROVIDER` first, by name, so this bottom module depends on nothing
above it and the launch core never imports the training side.

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

__all__ = ["GROUP_JOIN_PROVIDER", "join_rank_group", "register_group_join", "register_rank_reset",
           "reset_rank_state", "unregister_rank_reset"]

GROUP_JOIN_PROVIDER = "nbaccel.process_state"
"""The module that registers the group join when imported (nbaccel has one process state)."""

_resets: dict[str, Callable[[], None]] = {}
_group_join: list[Callable[[], str]] = []  # at most one: the latest registered


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


def register_group_join(join: Callable[[], str]) -> None:
    """Make ``join()`` how a warm rank joins its process group; it returns the rank's device, as text.

    A later registration replaces an earlier one (a test's fake, then the real one again).
    """
    _group_join[:] = [join]


def join_rank_group() -> str:
    """Join this rank's process group (once for a warm rank's life); returns the rank's device, e.g. ``"cpu"``.

    Raises:
        RuntimeError: importing :data:`GROUP_JOIN_PROVIDER` registered no join (a broken install).
    """
    if not _group_join:
        importlib.import_module(GROUP_JOIN_PROVIDER)  # registers its join when imported
    if not _group_join:
        msg = (f"no group join is registered, and importing {GROUP_JOIN_PROVIDER!r} registered none. "
               "Fix: reinstall nbaccel (that module calls register_group_join when imported)")
        raise RuntimeError(msg)
    return _group_join[0]()
