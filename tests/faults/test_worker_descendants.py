"""What a worker starts (subprocesses, DataLoader workers) ends with the launch, whichever way it ends."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nbaccel import notebook_launcher
from nbaccel.launch.reaper import MARKER
from tests.launch.procs import alive, children
from tests.timed_out_launch import stop_at_a_timeout


def _start_a_sleeper_then(folder: str, then: str) -> int:
    import subprocess

    import torch
    from torch.utils.data import DataLoader

    rank = int(os.environ["RANK"])
    sleeper = subprocess.Popen(["sleep", "300"])
    Path(folder, f"sleeper-{rank}").write_text(str(sleeper.pid))
    loader = iter(DataLoader(torch.arange(64), batch_size=4, num_workers=2, persistent_workers=True))
    next(loader)  # the loader's worker processes are running now
    for child in Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split():
        Path(folder, f"child-{rank}-{child}").touch()
    if then == "raise" and rank == 1:
        raise RuntimeError("rank 1 fails with its subprocesses running")
    if then == "hang" and rank == 1:
        time.sleep(300)
    return rank


def _started(folder: Path) -> list[int]:
    return [int(p.read_text()) for p in folder.glob("sleeper-*")] + [
        int(p.name.rsplit("-", 1)[1]) for p in folder.glob("child-*")]


def _still_alive(pids: list[int]) -> list[int]:
    """The processes of ``pids`` still running a moment after the launch (SIGKILL takes a few ms)."""
    deadline = time.monotonic() + 5
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_failing_rank_takes_its_subprocesses_and_loader_workers_with_it(tmp_path, start_method):
    with pytest.raises(RuntimeError, match="rank 1 fails"):
        notebook_launcher(_start_a_sleeper_then, args=(str(tmp_path), "raise"), num_processes=2,
                          start_method=start_method)
    started = _started(tmp_path)
    assert len(list(tmp_path.glob("child-1-*"))) >= 3  # the failing rank's sleeper and two loader workers
    assert _still_alive(started) == [] and children() == []


def test_a_successful_launch_leaves_nothing_its_workers_started(tmp_path):
    assert notebook_launcher(_start_a_sleeper_then, args=(str(tmp_path), "return"), num_processes=2) == 0
    started = _started(tmp_path)
    assert started and _still_alive(started) == []


def test_a_timed_out_launch_stops_the_whole_tree(tmp_path):
    stop_at_a_timeout(lambda timeout: notebook_launcher(_start_a_sleeper_then, args=(str(tmp_path), "hang"),
                                                        num_processes=2, timeout=timeout),
                      got_there=lambda: len(list(tmp_path.glob("child-1-*"))) >= 3)  # the hanging rank's tree
    assert _still_alive(_started(tmp_path)) == []


def _processes_running(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in entry.joinpath("cmdline").read_bytes().decode(errors="replace") and alive(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _reapers_of(tag: str) -> list[int]:
    """The group reapers of processes started with NBACCEL_TEST_TAG=tag: a reaper inherits its launcher's environment.

    Not every reaper on the machine: another suite may run beside this one (scripts/test.sh).
    """
    found = []
    for pid in _processes_running(MARKER):
        try:
            environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"NBACCEL_TEST_TAG={tag}".encode() in environment:
            found.append(pid)
    return found


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_sigkilled_launcher_leaves_no_worker_subprocess_and_no_reaper(tmp_path, start_method):
    """The kernel is SIGKILLed mid-launch: workers die with it, and so does what they started."""
    script = tmp_path / "killed_launcher.py"
    script.write_text(textwrap.dedent(f"""
        import os, subprocess, sys, time
        from pathlib import Path
        from nbaccel import notebook_launcher

        def work(folder):
            sleeper = subprocess.Popen(["sleep", "300"])
            Path(folder, f"sleeper-{{os.environ['RANK']}}").write_text(str(sleeper.pid))
            time.sleep(300)

        notebook_launcher(work, args=(sys.argv[1],), num_processes=2, start_method={start_method!r})
    """))
    launcher = subprocess.Popen([sys.executable, str(script), str(tmp_path)], start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={**os.environ, "NBACCEL_TEST_TAG": str(tmp_path)})
    deadline = time.monotonic() + 90
    while len(list(tmp_path.glob("sleeper-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    sleepers = _started(tmp_path)
    assert len(sleepers) == 2
    assert _reapers_of(str(tmp_path)), "the launch runs with no group reaper of its own"
    launcher.kill()
    launcher.wait()
    assert _still_alive(sleepers) == []
    assert _still_alive(_processes_running(str(script))) == []  # the workers are gone
    assert _still_alive(_reapers_of(str(tmp_path))) == []  # and so is the launcher's reaper, its work done


def test_the_reaper_leaves_with_a_launcher_that_exits_normally(tmp_path):
    code = "from nbaccel import notebook_launcher\nprint(notebook_launcher(lambda: 7, num_processes=2))\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "NBACCEL_TEST_TAG": str(tmp_path)})
    assert result.stdout.strip() == "7", result.stderr[-2000:]
    assert _still_alive(_reapers_of(str(tmp_path))) == []


def _start_a_daemon(folder: str, then: str = "return") -> int:
    """Double fork + setsid, as a daemon does: the sleeper leaves the worker's process group and session."""
    rank = int(os.environ["RANK"])
    read_end, write_end = os.pipe()
    if os.fork() == 0:  # the first child: a new session, then fork the daemon and leave
        os.setsid()
        if os.fork() == 0:
            os.close(read_end)
            os.write(write_end, str(os.getpid()).encode())
            os.close(write_end)
            os.execvp("sleep", ["sleep", "300"])
        os._exit(0)
    os.close(write_end)
    daemon = int(os.read(read_end, 64))
    os.close(read_end)
    Path(folder, f"daemon-{rank}").write_text(str(daemon))
    if then == "raise" and rank == 1:
        raise RuntimeError("rank 1 fails with its daemon running")
    if then == "hang" and rank == 1:
        time.sleep(300)
    return daemon


def _daemons(folder: Path) -> list[int]:
    return [int(p.read_text()) for p in folder.glob("daemon-*")]


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_daemon_a_worker_started_ends_with_a_successful_launch(tmp_path, start_method):
    notebook_launcher(_start_a_daemon, args=(str(tmp_path),), num_processes=2, start_method=start_method)
    daemons = _daemons(tmp_path)
    assert len(daemons) == 2 and _still_alive(daemons) == []


def test_a_daemon_ends_with_a_failing_launch_and_with_the_ranks_it_stopped(tmp_path):
    with pytest.raises(RuntimeError, match="rank 1 fails with its daemon"):
        notebook_launcher(_start_a_daemon, args=(str(tmp_path), "raise"), num_processes=2)
    daemons = _daemons(tmp_path)
    assert len(daemons) == 2 and _still_alive(daemons) == []


def test_a_daemon_ends_with_a_rank_stopped_at_the_timeout(tmp_path):
    stop_at_a_timeout(lambda timeout: notebook_launcher(_start_a_daemon, args=(str(tmp_path), "hang"),
                                                        num_processes=2, timeout=timeout),
                      got_there=lambda: len(_daemons(tmp_path)) == 2)
    daemons = _daemons(tmp_path)
    assert len(daemons) == 2 and _still_alive(daemons) == []


def test_daemons_started_in_pool_runs_end_when_the_pool_closes(tmp_path):
    from nbaccel import WorkerPool

    with WorkerPool(num_processes=2, use_cpu=True) as pool:
        daemons = list(pool.run(_start_a_daemon, str(tmp_path), return_all=True).values())
        assert all(alive(p) for p in daemons)  # a pool's workers keep what they started between runs
    assert _still_alive(daemons) == []
