"""Launch requests the machine cannot hold, and a start that fails part-way: refused or undone, nothing leaked."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from nbaccel import ConfigError, notebook_launcher
from tests.launch.procs import children, open_fds


def _answer() -> int:
    return 42


def test_an_oversized_num_processes_is_refused_before_anything_is_opened():
    fds = open_fds()
    with pytest.raises(ConfigError, match=r"num_processes=10000 needs about \d+ file descriptors .*Fix: pass "
                                          r"num_processes<=\d+") as info:
        notebook_launcher(_answer, num_processes=10000)
    assert info.value.key == "num_processes"
    assert open_fds() == fds and children() == []
    assert notebook_launcher(_answer, num_processes=2) == 42  # the process is still fine


def test_more_cpu_workers_than_memory_allows_are_refused(monkeypatch):
    monkeypatch.setattr("nbaccel.launch.preflight.available_cpu_memory", lambda: 3 * 64 * 2**20)
    with pytest.raises(ConfigError, match=r"num_processes=4 CPU workers need at least .* GiB is available\. "
                                          r"Fix: pass num_processes<=3"):
        notebook_launcher(_answer, num_processes=4)
    assert children() == []


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def test_a_low_descriptor_limit_names_ulimit_and_the_number_that_fits():
    result = _run("""
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (80, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        from nbaccel import notebook_launcher
        try:
            notebook_launcher(lambda: 1, num_processes=8)
        except Exception as exc:
            print(type(exc).__name__, exc)
    """)
    assert "ConfigError num_processes=8 needs about 96 file descriptors" in result.stdout, result.stderr
    assert "`ulimit -n`" in result.stdout and "num_processes<=" in result.stdout


def test_a_fork_refused_part_way_kills_the_started_workers_and_closes_every_pipe():
    """The kernel refuses the third fork (EAGAIN: a process limit): the two workers already forked are
    killed and reaped, every pipe is closed, and the next launch works."""
    result = _run("""
        import errno, os
        from nbaccel import notebook_launcher
        from tests.launch.procs import children, open_fds

        def sleeper():
            import time
            time.sleep(60)

        notebook_launcher(lambda: 0, num_processes=2)  # the rendezvous store's first use opens its own fds
        before = open_fds()
        real_fork, forks = os.fork, []
        def refusing_fork():
            if len(forks) == 2:
                raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
            pid = real_fork()
            if pid:
                forks.append(pid)
            return pid
        os.fork = refusing_fork
        try:
            notebook_launcher(sleeper, num_processes=4)
        except BlockingIOError as exc:
            print("refused:", exc)
        os.fork = real_fork
        print("forked", len(forks), "left", children(), "leaked fds", sorted(open_fds() - before))
        print("again", notebook_launcher(lambda: 42, num_processes=2))
    """)
    assert "refused: [Errno 11] Resource temporarily unavailable" in result.stdout, result.stderr
    assert "forked 2 left [] leaked fds []" in result.stdout, result.stdout + result.stderr
    assert "again 42" in result.stdout
