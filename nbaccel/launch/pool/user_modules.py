"""Which imported modules are the user's, and whether one changed on disk: when a warm rank must be replaced.

A warm rank (:mod:`nbaccel.launch.pool.warm`) keeps the modules it imported, so one the user edited
since would run stale. The user's modules are those whose file lies outside Python, the
environment's packages and nbaccel; the caller checks its own and those each run imported in the
rank (:func:`new_user_module_files`).
"""

from __future__ import annotations

import os
import sys
import sysconfig
from collections.abc import Iterable
from pathlib import Path

__all__ = ["changed_since", "new_user_module_files", "user_module_files"]


def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, str(Path(__file__).resolve().parents[2]),  # nbaccel
             *(paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths)}
    roots = {r for r in roots if r}
    return tuple({os.path.join(form, "") for r in roots for form in (os.path.abspath(r), os.path.realpath(r))})


_LIBRARIES = _library_roots()
_user_files: dict[str, bool] = {}  # a module's file -> whether it is the user's (not Python's, a package's, nbaccel's)
_user_paths: tuple[int, list[str]] = (-1, [])  # (len(sys.modules) when listed, the user's module files then)
_reported: set[str] = set()  # in a rank: the files already reported to the caller


def user_module_files() -> list[str]:
    """The files of the user's imported modules, listed again only when a module was imported or dropped.

    Example:
        >>> all(not path.endswith("/os.py") for path in user_module_files())
        True
    """
    global _user_paths
    count = len(sys.modules)
    if _user_paths[0] != count:
        paths = []
        for module in list(sys.modules.values()):
            path = getattr(module, "__file__", None)
            if not isinstance(path, str):
                continue
            mine = _user_files.get(path)
            if mine is None:  # realpath only where the path itself says nothing
                mine = _user_files[path] = not (path.startswith(_LIBRARIES)
                                                or os.path.realpath(path).startswith(_LIBRARIES))
            if mine:
                paths.append(path)
        _user_paths = (count, paths)
    return _user_paths[1]


def new_user_module_files(module_count: int) -> tuple[str, ...]:
    """In a rank: the user's module files not reported before, when ``sys.modules`` no longer has ``module_count``."""
    if len(sys.modules) == module_count:
        return ()
    new = tuple(path for path in user_module_files() if path not in _reported)
    _reported.update(new)
    return new


def changed_since(paths: Iterable[tuple[str, float]]) -> bool:
    """Whether any ``(file, since)`` was modified after ``since`` (a file that is gone does not count)."""
    for path, since in paths:
        try:
            if os.stat(path).st_mtime > since:
                return True
        except OSError:
            continue
    return False
