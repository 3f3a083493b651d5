"""Shared test setup: quiet thread pools and a private config file for every test."""

from __future__ import annotations

import os
import signal
import sys

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

# --doctest-modules imports every module under tests/; this one makes torch look CUDA-built for the
# whole process, so it is only ever imported by the subprocesses that simulate a CUDA parent.
collect_ignore = ["fake_cuda_runtime.py", "fake_cuda_on_import.py"]


def pytest_configure(config):
    """Interrupts work however the suite was started.

    A shell starts a background job (``scripts/test.sh &``) with SIGINT ignored, and an ignored
    disposition is inherited through fork and exec: the tests that interrupt a launch would then
    interrupt nothing. Python's own handler is installed here, so this process, the workers it
    forks and the interpreters it starts all get SIGINT as a terminal would deliver it.
    """
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _a_launch_leftover(pid: int) -> bool:
    """A forked worker (this process's own command line) or a spawned one (nbaccel's trampoline).

    Services a library keeps for the whole process (wandb's, started by an in-process tracker
    test) are not leftovers: killing one breaks that library for every later test.
    """
    line = _cmdline(pid)
    return line == _cmdline(os.getpid()) or b"nbaccel" in line


@pytest.fixture(autouse=True)
def _no_leftovers_between_tests():
    """A test sees only the child processes it started; launch workers it leaves running are killed after it.

    A test that fails part-way can leave workers behind; counted by the next test's "nothing is
    left running" check, they used to fail tests that had done nothing wrong.
    """
    from tests.launch import procs

    procs.BEFORE_THIS_TEST = set(procs.all_children())
    yield
    warm = sys.modules.get("nbaccel.launch.pool.warm")
    if warm is not None:  # the kept one-process rank is the test's own: each test starts without one
        warm.close_warm_rank()
    left = [pid for pid in procs.all_children() if pid not in procs.BEFORE_THIS_TEST and _a_launch_leftover(pid)]
    procs.BEFORE_THIS_TEST = set()
    for pid in left:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:  # a Popen or a pool reaped it already
            pass


@pytest.fixture(autouse=True)
def _private_config(tmp_path, monkeypatch):
    monkeypatch.setenv("NBACCEL_CONFIG_FILE", str(tmp_path / "nbaccel_config.yaml"))
    yield
