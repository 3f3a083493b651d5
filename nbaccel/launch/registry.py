"""Finding the launcher for a request, and running it: adding a launcher is adding a module.

The launcher named ``x`` is ``LAUNCHER`` in the module ``nbaccel.launch.x`` (``local``, ``xla``,
``elastic`` ship with nbaccel), imported only when a request asks for it, so torch_xla or torch
elastic cost nothing to a launch that does not use them. Launchers defined elsewhere are added
with :func:`register_launcher`.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from typing import Any

from nbaccel.errors import ConfigError
from nbaccel.launch.base import Launcher
from nbaccel.launch.preflight import say
from nbaccel.launch.request import LaunchRequest

__all__ = ["available_launchers", "launch", "launcher_for", "register_launcher"]

_registered: dict[str, Launcher] = {}


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
    here = Path(__file__).parent
    own = [m.name for m in pkgutil.iter_modules([str(here)])
           if "\nLAUNCHER = " in (here / f"{m.name}.py").read_text(encoding="utf-8", errors="replace")]
    return sorted(set(own) | set(_registered))


def launcher_for(name: str) -> Launcher:
    """The launcher called ``name``.

    Raises:
        ConfigError: no launcher has that name.
    """
    if name in _registered:
        return _registered[name]
    module = None
    if name.isidentifier():
        try:
            module = importlib.import_module(f"nbaccel.launch.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"nbaccel.launch.{name}":
                raise
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
    results = launcher.launch(request)
    if request.return_all:
        return results
    return results.get(0, results[min(results)] if results else None)
