"""Finding the launcher for a request, and running it: one explicit table of nbaccel's launchers.

:data:`BUILTIN_LAUNCHERS` maps each launcher nbaccel ships to the module whose ``LAUNCHER`` it is,
imported only when a request asks for it, so torch_xla, torch elastic or Ray cost nothing to a
launch that does not use them. Adding a launcher to nbaccel is a module plus a row here;
launchers defined elsewhere are added with :func:`register_launcher`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from nbaccel.errors import ConfigError
from nbaccel.launch.base import Launcher
from nbaccel.launch.claims import refuse_claimed
from nbaccel.launch.preflight import say
from nbaccel.launch.request import LaunchRequest

__all__ = ["BUILTIN_LAUNCHERS", "available_launchers", "before_each_launch", "launch", "launcher_for",
           "register_launcher", "run_before_launch"]

BUILTIN_LAUNCHERS: dict[str, str] = {
    "elastic": "nbaccel.launch.elastic.launcher",  # several machines: torch's elastic agent
    "local": "nbaccel.launch.local.launcher",  # this machine: forked or spawned workers
    "warm": "nbaccel.launch.pool.warm",  # one process on this machine: the rank kept warm per kernel
    "ray": "nbaccel.launch.ray.launcher",  # Ray actors in a placement group
    "xla": "nbaccel.launch.xla.launcher",  # TPU cores through torch_xla.launch
}
"""Launcher name -> the module holding it as ``LAUNCHER``."""
_registered: dict[str, Launcher] = {}
# First: a GPU or the warm rank that a background run holds refuses the launch before anything is released.
_before_launch: list[Callable[[LaunchRequest], None]] = [refuse_claimed]


def before_each_launch(hook: Callable[[LaunchRequest], None]) -> None:
    """Call ``hook(request)`` before every launch starts (a warm rank gives up a GPU a launch needs)."""
    if hook not in _before_launch:
        _before_launch.append(hook)


def run_before_launch(request: LaunchRequest) -> None:
    """Call every :func:`before_each_launch` hook for ``request`` (a launch here; a pool before it starts)."""
    for hook in _before_launch:
        hook(request)


def register_launcher(launcher: Launcher) -> None:
    """Make ``launcher`` available as ``launcher.name`` (for launchers outside ``nbaccel.launch``).

    Raises:
        ConfigError: ``launcher`` does not implement the :class:`~nbaccel.launch.base.Launcher` protocol.
    """
    if not isinstance(launcher, Launcher):
        raise ConfigError(f"{launcher!r} is not a Launcher: it needs a `name` and a `launch(request)` method. "
                          "Fix: implement nbaccel.launch.base.Launcher.", key="launcher", value=launcher,
                          valid="a Launcher")
    _registered[launcher.name] = launcher


def available_launchers() -> list[str]:
    """The launcher names known here: nbaccel's own modules, then registered ones.

    Example:
        >>> {"local", "xla", "elastic"} <= set(available_launchers())
        True
    """
    return sorted(set(BUILTIN_LAUNCHERS) | set(_registered))


def launcher_for(name: str) -> Launcher:
    """The launcher called ``name``.

    Raises:
        ConfigError: no launcher has that name.
    """
    if name in _registered:
        return _registered[name]
    module = importlib.import_module(BUILTIN_LAUNCHERS[name]) if name in BUILTIN_LAUNCHERS else None
    found = getattr(module, "LAUNCHER", None)
    if not isinstance(found, Launcher):
        valid = available_launchers()
        raise ConfigError(f"launcher {name!r} does not exist; valid launchers: {valid}. Fix: pass one of those, or "
                          "register yours with nbaccel.launch.registry.register_launcher.", key="launcher",
                          value=name, valid=valid)
    return found


def launch(request: LaunchRequest) -> Any:
    """Run ``request`` with its launcher; rank 0's value, or ``{rank: value}`` when ``return_all``.

    On several machines rank 0 may run elsewhere: then this machine's lowest rank's value.
    """
    launcher = launcher_for(request.launcher)
    say(request.plan.note)
    run_before_launch(request)
    results = launcher.launch(request)
    if request.return_all:
        return results
    return results.get(0, results[min(results)] if results else None)
