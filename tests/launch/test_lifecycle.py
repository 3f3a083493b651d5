"""Interrupts, timeouts, the hang watchdog, and nothing left behind after a launch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nbaccel import LaunchError, LaunchTimeoutError, notebook_launcher

from ..pool.helpers import wait_for
from .procs import alive, children, handlers, listening, open_fds, socket_inodes

PY = sys.executable


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "launch_script.py"
    path.write_text(textwrap.dedent(body))
    return path




SLEEPERS = """
    import os, sys, time
    from nbaccel import notebook_launcher

    def sleeper(pid_dir):
        open(os.path.join(pid_dir, str(os.getpid())), "w").close()
        time.sleep(120)

    try:
        notebook_launcher(sleeper, (sys.argv[1],), num_processes=3)
        print("RETURNED")
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
"""


def _start_sleepers(tmp_path: Path) -> tuple[subprocess.Popen, Path, list[int]]:
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    proc = subprocess.Popen([PY, str(_script(tmp_path, SLEEPERS)), str(pid_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert wait_for(lambda: len(os.listdir(pid_dir)) == 3, 60), proc.communicate(timeout=5)
    return proc, pid_dir, [int(p) for p in os.listdir(pid_dir)]


def test_sigint_to_the_process_group_stops_every_worker_and_is_an_interrupt(tmp_path):
    proc, _, pids = _start_sleepers(tmp_path)
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)  # what Jupyter's Interrupt does
    out, err = proc.communicate(timeout=15)
    assert time.monotonic() - sent < 5
    assert "INTERRUPTED" in out and "RETURNED" not in out, err
    # Killed workers the launcher has not reaped yet are re-parented when it exits; on a loaded machine
    # the last one can take a moment to go (the same few seconds the SIGKILL test allows).
    assert wait_for(lambda: not any(alive(p) for p in pids), 5), [p for p in pids if alive(p)]


def test_sigkill_of_the_parent_takes_the_workers_with_it(tmp_path):
    proc, _, pids = _start_sleepers(tmp_path)
    proc.kill()
    proc.wait()
    assert wait_for(lambda: not any(alive(p) for p in pids), 5), [p for p in pids if alive(p)]


def test_sigkill_of_a_spawning_parent_leaves_no_temp_folder(tmp_path):
    """The spawn payload's private folder goes as soon as every worker has read it, not only at the end."""
    own_tmp = tmp_path / "tmp"
    own_tmp.mkdir()
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    body = SLEEPERS.replace("num_processes=3)", "num_processes=3, start_method='spawn')")
    proc = subprocess.Popen([PY, str(_script(tmp_path, body)), str(pid_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "TMPDIR": str(own_tmp)})
    assert wait_for(lambda: len(os.listdir(pid_dir)) == 3, 90), proc.communicate(timeout=5)
    pids = [int(p) for p in os.listdir(pid_dir)]
    proc.kill()
    proc.wait()
    assert wait_for(lambda: not any(alive(p) for p in pids), 5), [p for p in pids if alive(p)]
    assert list(own_tmp.iterdir()) == []


def _quick(x):
    return x + int(os.environ["RANK"])


def test_thirty_launches_leave_nothing_behind():
    notebook_launcher(_quick, (0,), num_processes=2)  # warm-up: lazy imports open their files once
    fds, before_handlers = open_fds(), handlers()
    listening_before = set(listening(socket_inodes(os.getpid())))
    for i in range(30):
        assert notebook_launcher(_quick, (i,), num_processes=2, return_all=True) == {0: i, 1: i + 1}
    assert children() == []
    assert open_fds() == fds
    assert handlers() == before_handlers
    assert set(listening(socket_inodes(os.getpid()))) == listening_before


def _report_listeners():
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    mine = listening(socket_inodes(os.getpid())) + listening(socket_inodes(os.getppid()))
    return mine, int(os.environ["MASTER_PORT"])


def test_single_machine_launch_listens_on_loopback_only():
    results = notebook_launcher(_report_listeners, num_processes=2, return_all=True)
    for rank, (sockets, port) in results.items():
        assert sockets, f"rank {rank} reported no listening socket"
        assert all(addr == "127.0.0.1" for addr, _ in sockets), sockets
        assert ("127.0.0.1", port) in sockets  # the launcher's own rendezvous store


def test_back_to_back_launches_get_fresh_ports():
    ports = [notebook_launcher(_report_listeners, num_processes=2)[1] for _ in range(3)]
    assert len(ports) == 3 and all(ports)


def test_a_port_in_use_is_a_clear_error():
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    try:
        with pytest.raises(LaunchError, match="already in use") as info:
            notebook_launcher(_quick, (0,), num_processes=2, use_port=sock.getsockname()[1])
        assert "use_port" in str(info.value)
    finally:
        sock.close()
    assert children() == []


def _sleep_forever():
    time.sleep(600)


def test_timeout_stops_the_launch_and_dumps_stacks(capfd):
    start = time.monotonic()
    with pytest.raises(LaunchTimeoutError) as info:
        notebook_launcher(_sleep_forever, num_processes=2, timeout=1.5)
    assert time.monotonic() - start < 10
    assert info.value.reason == "timeout" and sorted(info.value.stacks) == [0, 1]
    assert "_sleep_forever" in info.value.stacks[1]
    assert children() == []
    _, err = capfd.readouterr()
    assert "[rank1]:" in err and "_sleep_forever" in err  # the dump reached the cell too


def _rank0_finishes_rank1_hangs():
    if os.environ["RANK"] == "1":
        time.sleep(600)
    return "done"


def test_hang_watchdog_dumps_the_stuck_rank_and_stops_it():
    with pytest.raises(LaunchTimeoutError) as info:
        notebook_launcher(_rank0_finishes_rank1_hangs, num_processes=2, hang_timeout=1.5)
    assert info.value.reason == "hang" and list(info.value.stacks) == [1]
    assert "_rank0_finishes_rank1_hangs" in info.value.stacks[1]
    assert "ranks [1] made no progress" in str(info.value)
    assert children() == []
