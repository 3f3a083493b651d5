"""What a rank forgets before it runs someone's function: a table that the other pillars fill.

A fresh worker, a Ray actor becoming a rank, an elastic worker, and a warm rank between two
tasks must not see the state of whoever ran before them (the notebook's ``Accelerator``, an
earlier task's process group or trackers). The launch core does not know what that state is:
each module that keeps such state registers how to forget it when it is imported
(:func:`register_rank_reset`), and every backend calls :func:`reset_rank_state`. A module that
was never imported here has nothing to forget.

Example:
    >>> calls = []
    >>> register_rank_reset("example", lambda: calls.append("reset"))
    >>> reset_rank_state(); calls
    ['reset']
    >>> unregister_rank_reset("example")
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["register_rank_reset", "reset_rank_state", "unregister_rank_reset"]

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
