"""Running a callback right after a module is first imported (a worker adapts libraries it loads later).

A spawned worker imports IPython or ``comm`` only when the user's code does (paying for them up
front would cost more than a whole fork launch), so :func:`when_imported` leaves one finder on
``sys.meta_path`` that wraps the named module's loader and runs the callback once it executed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["when_imported"]


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.callbacks: dict[str, list[Callable[[ModuleType], None]]] = {}

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        callbacks = self.callbacks.pop(fullname, None)
        if callbacks is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        original = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original(module)
            for callback in callbacks:
                callback(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]  # wrapped on purpose
        return spec


_finder = _AfterImport()


def when_imported(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` now if ``name`` is loaded, else right after it is first imported.

    Example:
        >>> seen = []
        >>> when_imported("json", lambda module: seen.append(module.__name__))
        >>> seen
        ['json']
    """
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    _finder.callbacks.setdefault(name, []).append(callback)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
