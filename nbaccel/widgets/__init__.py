"""Notebook widgets: the launch configuration panel and the live status panel of a launch.

ipywidgets is imported only when a panel is built, under a guard that says how to install it;
every panel also has a plain-text form for terminals, logs and nbconvert output.
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

from nbaccel.errors import MissingDependencyError

__all__ = ["import_widgets", "widgets_available"]


def widgets_available() -> bool:
    """Whether ipywidgets can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec("ipywidgets") is not None
    except ValueError:  # a module object without a spec, e.g. one set to None in sys.modules
        return False


def import_widgets(needed_for: str) -> ModuleType:
    """Import ipywidgets, or say how to install it.

    Raises:
        MissingDependencyError: ipywidgets is not installed.
    """
    try:
        import ipywidgets
    except ImportError:
        raise MissingDependencyError(
            f"{needed_for} needs ipywidgets, which is not installed. Fix: pip install ipywidgets "
            "(and restart the kernel); until then nbaccel prints plain text instead.",
            package="ipywidgets", needed_for=needed_for, install="pip install ipywidgets") from None
    return ipywidgets
