"""Fault matrix, round two, the rendezvous row: only the launch's own ranks reach its store.

Another local user, and a process of the same user that is not one of the launch's workers, are
refused on connect (their connection is closed before they read or write a key); going around the
front to the store's real port does not connect at all; the rank's own value is the one the store
holds, and a real 2-process launch over gloo still works.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from nbaccel import notebook_launcher
from nbaccel.launch.rendezvous import LoopbackStore

CLIENT = """
import sys
from datetime import timedelta
import torch.distributed as dist
port, value = int(sys.argv[1]), sys.argv[2]
if value == "rank":
    sys.stdin.readline()  # started before the store serves, as a launch's workers are
try:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
    store.set("rank0/address", value)
    print("WROTE", store.get("rank0/address").decode())
except Exception as exc:
    print("REFUSED", type(exc).__name__)
"""


# Another user cannot run this venv's interpreter; a bare socket is all it needs to knock.
OTHER_USER = """
import socket, sys
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=30)
try:
    sock.sendall(b"\\x00" * 64)  # whatever torch's client sends first
    print("REFUSED" if sock.recv(1) == b"" else "ANSWERED")
except OSError:
    print("REFUSED")
"""


def _client(port: int, value: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CLIENT, str(port), value], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, **popen)


def test_strangers_are_refused_on_connect_and_the_ranks_value_stands():
    store = LoopbackStore()
    rank = _client(store.port, "rank")
    try:
        store.serve([rank.pid])
        same_user = _client(store.port, "evil")
        assert same_user.communicate(timeout=120)[0].startswith("REFUSED")
        if os.geteuid() == 0 and os.path.exists("/usr/bin/python3"):  # root can be another user for a moment
            other_user = subprocess.run(["/usr/bin/python3", "-c", OTHER_USER, str(store.port)], user=65534,
                                        group=65534, capture_output=True, text=True, timeout=120, cwd="/")
            assert other_user.stdout.strip() == "REFUSED", other_user.stderr
        rank.stdin.write("go\n")
        rank.stdin.flush()
        assert rank.communicate(timeout=120)[0].strip() == "WROTE rank"
        assert store._store.get("rank0/address") == b"rank"  # nothing else was written
        reasons = [why for _, why in store.rejected]
        assert "it is not one of the launch's workers" in reasons
        if os.geteuid() == 0 and os.path.exists("/usr/bin/python3"):
            assert "it belongs to uid 65534" in reasons
        around = socket.socket()
        around.settimeout(3)
        with pytest.raises(OSError):  # the real port drops what the relay did not open
            around.connect(("127.0.0.1", store.guard.real_port))
        around.close()
    finally:
        rank.kill()
        store.close()


def _all_reduce() -> float:
    import torch
    import torch.distributed as dist

    from nbaccel import Accelerator

    accelerator = Accelerator()
    total = torch.ones(1) * (accelerator.process_index + 1)
    dist.all_reduce(total)
    return total.item()


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_launch_through_the_guard_still_joins_its_process_group(start_method):
    assert notebook_launcher(_all_reduce, num_processes=2, start_method=start_method) == 3.0


def test_a_process_that_reached_the_store_before_it_was_locked_stops_the_launch():
    from datetime import timedelta

    import torch.distributed as dist

    from nbaccel.errors import LaunchError
    from nbaccel.launch.store_guard import StoreGuard

    guard = StoreGuard()
    knock = ("import socket, sys, time; s = socket.create_connection(('127.0.0.1', int(sys.argv[1]))); "
             "print('in', flush=True); time.sleep(60)")
    early = subprocess.Popen([sys.executable, "-c", knock, str(guard.real_port)], stdout=subprocess.PIPE, text=True)
    assert early.stdout.readline().strip() == "in"  # connected before start(): the port is not locked yet
    try:
        with pytest.raises(LaunchError, match=r"connected to the rendezvous store .* before it was locked"):
            guard.start(lambda fd: dist.TCPStore("127.0.0.1", guard.real_port, world_size=None, is_master=True,
                                                 master_listen_fd=fd, use_libuv=True, wait_for_workers=False,
                                                 timeout=timedelta(seconds=30)), [os.getpid()])
    finally:
        early.kill()
        early.wait()
        guard.close()


def test_an_interrupt_inside_the_guard_start_leaves_close_working(monkeypatch):
    """SIGINT can land while the relay thread is being started (seen once in a background-job run): the
    launch's cleanup must then close the store, not fail with 'cannot join thread before it is started'."""
    import threading

    from nbaccel.launch.store_guard import StoreGuard

    def interrupted_start(self):
        raise KeyboardInterrupt

    guard = StoreGuard()
    monkeypatch.setattr(threading.Thread, "start", interrupted_start)
    with pytest.raises(KeyboardInterrupt):
        guard.start(lambda fd: os.close(fd), [os.getpid()])
    monkeypatch.undo()
    guard.close()
    assert guard.front.fileno() == -1 and guard.real.fileno() == -1


# Another user binds a port the relay has just freed and speaks TCPStore's protocol to the real port
# (VALIDATE with torch's magic number, SET, GET): the bare bytes torch's client sends.
PORT_THIEF = """
import socket, struct, sys, time
def text(b): return struct.pack("<Q", len(b)) + b
sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
deadline = time.monotonic() + 90
while True:  # free for anyone once the relay's side of the closed pair leaves TIME_WAIT
    try:
        sock.bind(("127.0.0.1", int(sys.argv[2])))
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.5)
sock.settimeout(5)
try:
    sock.connect(("127.0.0.1", int(sys.argv[1])))
    sock.sendall(bytes([0]) + struct.pack("<I", 0x3C85F7CE))
    sock.sendall(bytes([1]) + text(b"rank0/address") + text(b"evil"))
    sock.sendall(bytes([3]) + text(b"rank0/address"))
    size = struct.unpack("<Q", sock.recv(8))[0]
    print("WROTE", sock.recv(size).decode())
except (OSError, struct.error) as exc:
    print("REFUSED", type(exc).__name__)
"""


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"), reason="needs root to be another user")
def test_a_port_a_closed_relay_freed_does_not_open_the_store_to_another_user():
    """A pool task ending with destroy_process_group() closes its relay pair: the port it used must not
    stay in the real port's filter, or a process of another uid that binds it reaches the store."""
    import time

    store = LoopbackStore()
    rank = _client(store.port, "rank")
    try:
        store.serve([rank.pid])
        rank.stdin.write("go\n")
        rank.stdin.flush()
        assert rank.stdout.readline().strip() == "WROTE rank"
        freed = set(store.guard._relay_ports)
        assert freed  # the rank is connected through the relay
        rank.stdin.close()  # the client exits: its relay pair closes
        rank.wait(timeout=60)
        deadline = time.monotonic() + 60
        while freed & store.guard._relay_ports and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not freed & store.guard._relay_ports
        for port in sorted(freed):  # the port waits in TIME_WAIT for 60 s; root ends that wait now (ss -K)
            subprocess.run(["ss", "-K", "-tan", f"sport = :{port}"], capture_output=True, timeout=30, check=False)
            thief = subprocess.run(["/usr/bin/python3", "-c", PORT_THIEF, str(store.guard.real_port), str(port)],
                                   user=65534, group=65534, capture_output=True, text=True, timeout=120, cwd="/")
            assert thief.stdout.startswith("REFUSED"), (thief.stdout, thief.stderr)
        assert store._store.get("rank0/address") == b"rank"
    finally:
        rank.kill()
        store.close()
