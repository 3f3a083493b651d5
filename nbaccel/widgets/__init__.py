"""Notebook widgets: the launch configuration panel and the live status panel of a launch.

ipywidgets is imported only when a panel is built, under a guard that says how to install it;
every panel also has a plain-text form for terminals, logs and nbconvert output.

The panels work with ipywidgets 7.7 as well as 8: Colab ships 7.7.1 and imports it when the
kernel starts, so an upgrade would need a restart. The few APIs that differ (how a widget is
displayed, accordion titles, tooltips) go through the helpers here.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from nbaccel.errors import MissingDependencyError

__all__ = ["import_widgets", "set_titles", "tooltip", "widget_bundle", "widgets_available"]


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


def widget_bundle(widget: Any, text: str) -> dict[str, Any]:
    """The display data of ``widget`` with ``text`` as its plain-text form, on ipywidgets 7 and 8.

    ipywidgets 8 widgets have ``_repr_mimebundle_``; 7 displays them from ``_ipython_display_``
    instead, with the same widget-view data built here.

    Example:
        >>> import ipywidgets
        >>> sorted(widget_bundle(ipywidgets.HTML("hi"), "hi"))
        ['application/vnd.jupyter.widget-view+json', 'text/plain']
    """
    if hasattr(widget, "_repr_mimebundle_"):
        bundle = dict(widget._repr_mimebundle_() or {})
    else:  # ipywidgets 7
        bundle = {"application/vnd.jupyter.widget-view+json": {"version_major": 2, "version_minor": 0,
                                                                "model_id": widget.model_id}}
    bundle["text/plain"] = text
    return bundle


def set_titles(container: Any, titles: Sequence[str]) -> None:
    """Set an ``Accordion``'s (or ``Tab``'s) titles on ipywidgets 7 (``set_title``) and 8 (``titles``)."""
    if "titles" in container.trait_names():
        container.titles = tuple(titles)
    else:  # ipywidgets 7
        for index, title in enumerate(titles):
            container.set_title(index, title)


def tooltip(text: str) -> dict[str, str]:
    """The keyword giving a control a hover text: ``tooltip`` on ipywidgets 8, ``description_tooltip`` on 7."""
    import ipywidgets

    return {"tooltip" if int(ipywidgets.__version__.split(".")[0]) >= 8 else "description_tooltip": text}
