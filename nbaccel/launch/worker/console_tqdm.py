"""Text progress bars in workers forked from a Jupyter kernel: ``tqdm.auto`` picks the console bar there.

``tqdm.auto`` chooses its notebook bar (an ipywidget) when ``ipykernel.zmqshell`` is imported,
which is true in every worker forked from a kernel, and a widget made in a worker cannot reach the
frontend. In a worker, :func:`use_console_tqdm` makes ``tqdm.auto`` and ``tqdm.autonotebook`` give
the text bar instead, whose ``\\r`` redraws reach the status panel as one bar per rank. A ``tqdm``
name a notebook cell bound to the notebook bar (``from tqdm.auto import tqdm``) stays the
notebook's class; import it inside the launched code.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = ["use_console_tqdm"]

_KERNEL = "ipykernel.zmqshell"
_AUTO = ("tqdm.autonotebook", "tqdm.auto")


class _HidingLoader(importlib.abc.Loader):
    """Runs a module with the kernel module out of ``sys.modules``, so tqdm detects a console."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        hidden = sys.modules.pop(_KERNEL, None)
        try:
            self.inner.exec_module(module)
        finally:
            if hidden is not None:
                sys.modules[_KERNEL] = hidden


class _ConsoleTqdmFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if name not in _AUTO:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _HidingLoader(spec.loader)
        return spec


def use_console_tqdm() -> None:
    """In this worker, make ``tqdm.auto`` / ``tqdm.autonotebook`` the text bar (only if forked from a kernel).

    Example:
        >>> use_console_tqdm()   # outside a kernel: nothing to do
    """
    if _KERNEL not in sys.modules:
        return
    loaded = [name for name in _AUTO if name in sys.modules]
    if loaded:
        from tqdm.asyncio import tqdm as console_tqdm
        from tqdm.std import trange

        for name in loaded:
            sys.modules[name].tqdm = console_tqdm  # type: ignore[attr-defined]  # replaced on the loaded module
            sys.modules[name].trange = trange  # type: ignore[attr-defined]  # replaced on the loaded module
    if not any(isinstance(finder, _ConsoleTqdmFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _ConsoleTqdmFinder())
