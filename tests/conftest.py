"""Shared test setup: quiet thread pools and a private config file for every test."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

# --doctest-modules imports every module under tests/; this one makes torch look CUDA-built for the
# whole process, so it is only ever imported by the subprocesses that simulate a CUDA parent.
collect_ignore = ["fake_cuda_runtime.py"]


@pytest.fixture(autouse=True)
def _private_config(tmp_path, monkeypatch):
    monkeypatch.setenv("NBACCEL_CONFIG_FILE", str(tmp_path / "nbaccel_config.yaml"))
    yield
