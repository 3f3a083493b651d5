"""Every wait after SIGKILL is bounded: a rank that is never reaped is named, the cell does not hang.

A process stuck in the kernel (uninterruptible sleep, ``D`` state) cannot be made on purpose here
without root or a broken driver (a SIGSTOPped, ptraced or vfork-waiting child still dies on
SIGKILL), so these tests use a real sleeping process whose handle's ``poll`` never reports its
exit: to the supervisor it looks exactly like a process SIGKILL did not end.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from nbaccel.errors import LaunchError
from nbaccel.launch.failures import ProcessExit
from nbaccel.launch.handles import WorkerHandle, discard_workers, wait_reaped
from nbaccel.launch.output import OutputRelay
from nbaccel.launch.supervisor import Supervisor, SupervisorPolicy


class _NeverReaped(WorkerHandle):
    """A handle whose process never shows as exited, as one stuck in the kernel would."""

    def poll(self) -> ProcessExit | None:
        return None


def _sleeper_handle() -> tuple[subprocess.Popen[bytes], _NeverReaped, list[int]]:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    (ctl_r, ctl_w), (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe(), os.pipe()
    worker = _NeverReaped(rank=0, pid=sleeper.pid, ctl_fd=ctl_r, out_fd=out_r, err_fd=err_r)
    return sleeper, worker, [ctl_w, out_w, err_w]


def test_an_interrupted_run_whose_rank_is_never_reaped_names_it_instead_of_hanging() -> None:
    sleeper, handle, writers = _sleeper_handle()

    def interrupted() -> None:
        raise KeyboardInterrupt

    policy = SupervisorPolicy(grace=0.2, reap_timeout=0.5)
    began = time.monotonic()
    try:
        with pytest.raises(LaunchError) as info:
            Supervisor([handle], OutputRelay(), policy=policy).run(start=interrupted)
    finally:
        sleeper.kill()
        sleeper.wait()
        for fd in writers:
            os.close(fd)
    message = str(info.value)
    assert time.monotonic() - began < 10
    assert f"rank 0 (pid {sleeper.pid}) did not exit within 0.5s of SIGKILL" in message
    assert "stuck in the kernel" in message and f"/proc/{sleeper.pid}/stack" in message and "Fix:" in message
    assert isinstance(info.value.__context__, KeyboardInterrupt)  # the interrupt is still there to see


def test_discarding_workers_that_are_never_reaped_is_bounded_too() -> None:
    sleeper, handle, writers = _sleeper_handle()
    try:
        with pytest.raises(LaunchError, match=rf"rank 0 \(pid {sleeper.pid}\) did not exit within 5s of SIGKILL"):
            discard_workers([handle])  # a launch whose start failed: it kills, waits (bounded), closes the pipes
        assert sleeper.wait(timeout=10) == -9  # SIGKILL was sent all the same
    finally:
        sleeper.kill()
        sleeper.wait()
        for fd in writers:
            os.close(fd)


def test_a_worker_that_does_die_is_reaped_without_waiting_out_the_bound() -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    sleeper.kill()
    began = time.monotonic()
    wait_reaped([WorkerHandle(rank=0, pid=sleeper.pid, ctl_fd=-1, out_fd=-1, err_fd=-1, popen=sleeper)], 5.0)
    assert time.monotonic() - began < 2


_DESCENDANT_SURVIVES_SIGKILL = """
import os, signal, subprocess, sys, time
from nbaccel.launch.worker import descendants
sleeper = subprocess.Popen(["sleep", "60"])
really_kill = os.kill
descendants._REAP_TIMEOUT_S = 0.3
os.kill = lambda pid, sig: None  # SIGKILL withheld: to end_descendants the child looks stuck in the kernel
began = time.monotonic()
ended = descendants.end_descendants()
print(ended, round(time.monotonic() - began, 1) < 5)
really_kill(sleeper.pid, signal.SIGKILL)
sleeper.wait()
"""


def test_a_rank_ending_its_descendants_does_not_hang_on_one_sigkill_does_not_end() -> None:
    """A warm rank ends a task's children after each task; one stuck in the kernel must not keep it forever."""
    done = subprocess.run([sys.executable, "-c", _DESCENDANT_SURVIVES_SIGKILL], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.split() == ["0", "True"], done.stderr
    assert "did not exit within 0.3s of SIGKILL (stuck in the kernel" in done.stderr
    assert "/stack`); not waiting for it" in done.stderr
