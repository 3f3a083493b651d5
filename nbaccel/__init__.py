"""nbaccel: distributed PyTorch from a notebook, with Hugging Face Accelerate's API.

Names and subpackages (``nbaccel.big_modeling``, ``nbaccel.utils``, ...) are loaded on first use,
so ``import nbaccel`` stays fast and imports neither IPython nor ipywidgets.
``load_ipython_extension`` makes ``%load_ext nbaccel`` work.
"""

from __future__ import annotations

import importlib
from typing import Any

from nbaccel.exports import EXPORTS as _EXPORTS
from nbaccel.version import __version__  # noqa: F401 - re-exported (in __all__)

__all__ = sorted([*_EXPORTS, "__version__", "load_ipython_extension", "unload_ipython_extension"])


# Accelerate's import paths and the pillars: `nbaccel.big_modeling.X` after `import nbaccel`, as
# `accelerate.big_modeling.X` works after `import accelerate`; each is imported on first use.
_SUBPACKAGES = frozenset({"big_modeling", "data_loader", "hooks", "launch", "state", "tracking", "training", "utils",
                          "widgets"})


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        if name in _SUBPACKAGES:
            return importlib.import_module(f"nbaccel.{name}")  # also binds it as this package's attribute
        raise AttributeError(f"module 'nbaccel' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | _SUBPACKAGES)


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext nbaccel``: register nbaccel's magics."""
    from nbaccel.magics import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext nbaccel``: remove nbaccel's magics."""
    from nbaccel.magics import unload_ipython_extension as unload

    unload(ipython)
