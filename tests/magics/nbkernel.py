"""A real Jupyter kernel driven through nbclient, one cell at a time, for the magics' tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path
from typing import Any

import nbformat
from nbclient import NotebookClient


class NotebookKernel:
    """A kernel started with a private config file; :meth:`run` executes one more cell.

    The kernel's environment sets ``NBACCEL_CONFIG_FILE`` to ``config_file`` and
    ``OMP_NUM_THREADS=1``, so tests never touch the user's config.
    """

    def __init__(self, config_file: Path, timeout: int = 120, *, first_on_path: Path | None = None) -> None:
        self.config_file = config_file
        self.first_on_path = first_on_path  # a folder whose packages shadow the venv's (another ipywidgets)
        self.nb = nbformat.v4.new_notebook()
        self.nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        self.client = NotebookClient(self.nb, timeout=timeout, allow_errors=True, kernel_name="python3")
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> NotebookKernel:
        path = [str(self.first_on_path)] if self.first_on_path else []
        env = dict(os.environ, NBACCEL_CONFIG_FILE=str(self.config_file), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([*path, str(Path(__file__).resolve().parents[2])]))
        self._stack.enter_context(self.client.setup_kernel(env=env))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def run(self, source: str) -> nbformat.NotebookNode:
        """Execute ``source`` as a new cell; returns the cell with its outputs."""
        cell = nbformat.v4.new_code_cell(source)
        self.nb.cells.append(cell)
        self.client.execute_cell(cell, len(self.nb.cells) - 1)
        return cell

    def interrupt(self) -> None:
        """Interrupt the kernel the way Jupyter's Interrupt button does (``interrupt_kernel()``)."""
        asyncio.run(self.client.km.interrupt_kernel())


def stream_text(cell: nbformat.NotebookNode, name: str = "stdout") -> str:
    """Everything the cell wrote to ``name``."""
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream" and o.name == name)


def result_text(cell: nbformat.NotebookNode) -> str | None:
    """The cell's displayed value (``execute_result``), as text."""
    for output in cell.outputs:
        if output.output_type == "execute_result":
            return output.data.get("text/plain")
    return None


def error(cell: nbformat.NotebookNode) -> nbformat.NotebookNode | None:
    """The cell's error output, if it raised."""
    return next((o for o in cell.outputs if o.output_type == "error"), None)


def displays(cell: nbformat.NotebookNode) -> list[dict]:
    """The cell's display_data bundles (widgets, panels)."""
    return [dict(o.data) for o in cell.outputs if o.output_type in ("display_data", "update_display_data")]


