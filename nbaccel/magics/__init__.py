"""IPython magics: ``%load_ext nbaccel`` registers ``%%accel_launch``, ``%accel_workers``, ``%accel_config``,
``%accel_env``, ``%accel_runs``.

Loading imports only IPython and nbaccel's config (no torch, no ipywidgets, no device). Once a
cell has imported torch, what DDP needs is imported in a background thread while the user types
(see :mod:`nbaccel.launch.warmup`), so the first launch that trains does not wait for it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["load_ipython_extension", "unload_ipython_extension"]

_NAMES = {"cell": ("accel_launch",), "line": ("accel_config", "accel_env", "accel_runs", "accel_workers")}


def load_ipython_extension(ipython: Any) -> None:
    """Register nbaccel's magics class with ``ipython`` (``%load_ext nbaccel``).

    Example::

        %load_ext nbaccel
    """
    from nbaccel.launch.warmup import start_warmup
    from nbaccel.magics.magics import AccelMagics
    from nbaccel.magics.runs import RunsMagics

    ipython.register_magics(AccelMagics(ipython))
    ipython.register_magics(RunsMagics(ipython))
    events = getattr(ipython, "events", None)
    if events is not None and _warm_after_cell not in events.callbacks.get("post_run_cell", []):
        events.register("post_run_cell", _warm_after_cell)
    start_warmup()  # a no-op unless torch is imported already


def _warm_after_cell(*_: Any) -> None:
    from nbaccel.launch.warmup import start_warmup

    start_warmup()


def unload_ipython_extension(ipython: Any) -> None:
    """Remove nbaccel's magics from ``ipython`` (``%unload_ext nbaccel``)."""
    manager = ipython.magics_manager
    for kind, names in _NAMES.items():
        for name in names:
            manager.magics[kind].pop(name, None)
    manager.registry.pop("AccelMagics", None)
    manager.registry.pop("RunsMagics", None)
    events = getattr(ipython, "events", None)
    if events is not None and _warm_after_cell in events.callbacks.get("post_run_cell", []):
        events.unregister("post_run_cell", _warm_after_cell)
