"""An in-process IPython shell with nbaccel's magics loaded, fresh for every test."""

from __future__ import annotations

import pytest
from IPython.testing import globalipapp

import nbaccel.magics


@pytest.fixture
def ip():
    globalipapp.start_ipython()  # once per process; later calls return None
    shell = globalipapp.get_ipython()
    before = set(shell.user_ns)
    nbaccel.magics.load_ipython_extension(shell)
    yield shell
    nbaccel.magics.unload_ipython_extension(shell)
    for name in set(shell.user_ns) - before:
        del shell.user_ns[name]


def run(shell, source: str):
    """Run ``source`` as one cell; returns IPython's ``ExecutionResult``."""
    return shell.run_cell(source, store_history=True)
