"""Setup for the torch_xla tests: the CPU runtime, and torch_xla imported once, never initialized here.

These tests run in their own environment (tests/run_xla.sh) with ``PJRT_DEVICE=CPU``. The test
process itself must never initialize the XLA runtime: torch_xla then refuses to launch.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


@pytest.fixture(autouse=True)
def _runtime_stays_uninitialized():
    yield
    from nbaccel.hardware import xla_runtime_initialized

    assert not xla_runtime_initialized(), "a test initialized the XLA runtime in the test process"


@pytest.fixture
def devices(monkeypatch):
    """Set ``CPU_NUM_DEVICES`` (replicas of the CPU runtime) for one test."""
    def set_count(n: int) -> int:
        monkeypatch.setenv("CPU_NUM_DEVICES", str(n))
        return n
    monkeypatch.delenv("CPU_NUM_DEVICES", raising=False)
    return set_count
