"""Accelerate's own ``test_notebook.py`` script (from the installed package) run against nbaccel's launcher.

The script's functions are Accelerate's, unchanged: only the launcher they call is nbaccel's, and
the process count is 2 (CPU ranks over gloo). ``test_monitoring`` is the part that expects a
rank's ``RuntimeError`` to be caught as torch elastic's ``ChildFailedError``.
"""

from __future__ import annotations

import importlib
import signal

import pytest

import nbaccel

accelerate = pytest.importorskip("accelerate")


@pytest.fixture
def script(monkeypatch):
    """Accelerate's test_notebook module, calling nbaccel's notebook_launcher with 2 processes."""
    module = importlib.import_module("accelerate.test_utils.scripts.test_notebook")
    monkeypatch.setattr(module, "notebook_launcher", nbaccel.notebook_launcher)
    monkeypatch.setattr(module, "NUM_PROCESSES", 2)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield module
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def test_a_ranks_runtime_error_is_caught_as_child_failed_error_and_the_sleeper_stopped(script):
    script.test_monitoring(monitor_interval=0.01, sleep_sec=100)  # raises(ChildFailedError, match=...) inside


@pytest.mark.parametrize("name", ["test_can_initialize", "test_fault_tolerant", "test_static_rdzv_backend",
                                  "test_c10d_rdzv_backend"])
def test_the_scripts_other_launches_pass(script, name):
    getattr(script, name)()
