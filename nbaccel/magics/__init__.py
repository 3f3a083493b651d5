"""IPython magics: ``%load_ext nbaccel`` registers ``%%accel_launch``, ``%accel_config``, ``%accel_env``.

Loading imports only IPython and nbaccel's config (no torch, no ipywidgets, no device).
"""

from __future__ import annotations

from typing import Any

__all__ = ["load_ipython_extension", "unload_ipython_extension"]

_NAMES = {"cell": ("accel_launch",), "line": ("accel_config", "accel_env")}


def load_ipython_extension(ipython: Any) -> None:
    """Register nbaccel's magics class with ``ipython`` (``%load_ext nbaccel``).

    Example::

        %load_ext nbaccel
    """
    from nbaccel.magics.magics import AccelMagics

    ipython.register_magics(AccelMagics(ipython))


def unload_ipython_extension(ipython: Any) -> None:
    """Remove nbaccel's magics from ``ipython`` (``%unload_ext nbaccel``)."""
    manager = ipython.magics_manager
    for kind, names in _NAMES.items():
        for name in names:
            manager.magics[kind].pop(name, None)
    manager.registry.pop("AccelMagics", None)
