"""Finding a backend by name, and running a request on it: the one table of nbaccel's backends.

:data:`BACKENDS` maps each backend nbaccel ships to the module whose ``BACKEND`` it is, imported
only when asked for, so torch_xla, torch elastic or Ray cost nothing to a launch that does not use
them (docs/architecture.md, Registry). Launchers defined elsewhere are added with
:func:`register_launcher`.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from nbaccel.errors import ConfigError
from nbaccel.launch.backend import Backend
from nbaccel.launch.base import LaunchRequest, Launcher
from nbaccel.launch.claims import refuse_claimed
from nbaccel.launch.preflight import say

__all__ = ["BACKENDS", "available_launchers", "backend_for", "launch", "launcher_for", "register_launcher",
           "run_before_launch"]

BACKENDS: dict[str, str] = {
    "elastic": "nbaccel.launch.elastic.launcher",  # several machines: torch's elastic agent
    "local": "nbaccel.launch.local.launcher",  # this machine: forked or spawned workers
    "warm": "nbaccel.launch.pool.warm",  # one process on this machine: the rank kept warm per kernel
    "ray": "nbaccel.launch.ray.launcher",  # Ray actors in a placement group
    "xla": "nbaccel.launch.xla.launcher",  # TPU cores through torch_xla.launch
}
"""Backend name -> the module holding it as ``BACKEND``."""
_registered: dict[str, Backend] = {}


def run_before_launch(request: LaunchRequest) -> None:
    """Refuse what a background run holds, then call each loaded backend's ``before_launch`` with ``request``.

    A launch calls it, and a pool before it starts; a backend never imported holds nothing to give up.
    """
    refuse_claimed(request)  # first: a GPU or warm rank a background run holds refuses before anything is released
    for name, module in BACKENDS.items():
        hook = backend_for(name).before_launch if module in sys.modules else None
        if hook is not None:
            hook(request)


def register_launcher(launcher: Launcher) -> None:
    """Make ``launcher`` available as ``launcher.name`` (for launchers outside ``nbaccel.launch``).

    It becomes a :class:`~nbaccel.launch.base.Backend` planned by this machine's preflight.

    Raises:
        ConfigError: ``launcher`` does not implement the :class:`~nbaccel.launch.base.Launcher` protocol.
    """
    if not isinstance(launcher, Launcher):
        raise ConfigError(f"{launcher!r} is not a Launcher: it needs a `name` and a `launch(request)` method. "
                          "Fix: implement nbaccel.launch.base.Launcher.", key="launcher", value=launcher,
                          valid="a Launcher")
    _registered[launcher.name] = Backend(launcher)


def available_launchers() -> list[str]:
    """The backend names known here: nbaccel's own modules, then registered ones.

    Example:
        >>> {"local", "xla", "elastic"} <= set(available_launchers())
        True
    """
    return sorted(set(BACKENDS) | set(_registered))


def backend_for(name: str) -> Backend:
    """The backend called ``name`` (importing its module on first use).

    Raises:
        ConfigError: no backend has that name.
    """
    if name in _registered:
        return _registered[name]
    module = importlib.import_module(BACKENDS[name]) if name in BACKENDS else None
    found = getattr(module, "BACKEND", None)
    if not isinstance(found, Backend):
        valid = available_launchers()
        raise ConfigError(f"launcher {name!r} does not exist; valid launchers: {valid}. Fix: pass one of those, or "
                          "register yours with nbaccel.launch.registry.register_launcher.", key="launcher",
                          value=name, valid=valid)
    return found


def launcher_for(name: str) -> Launcher:
    """The launcher of the backend called ``name``.

    Raises:
        ConfigError: no backend has that name.
    """
    return backend_for(name).launcher


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
