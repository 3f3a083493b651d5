"""The XLA launch's teardown: it returns only once every process of the host's group is gone.

On a TPU a replica process holds the chips until the kernel has reclaimed it, so a launch that
returned sooner could make an immediate relaunch find the TPU busy. Runs without torch_xla.
"""

from __future__ import annotations

import subprocess
import sys

from nbaccel.host_memory import group_members
from nbaccel.launch.xla.launcher import _kill_group


def test_kill_group_returns_once_the_group_is_gone():
    # A process holding 400 MB takes a few milliseconds to die after SIGKILL: long enough to see.
    member = subprocess.Popen([sys.executable, "-c", "import time\nb = b'x' * (400 << 20)\nprint('ready', "
                               "flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert member.stdout.readline().strip() == b"ready"
        assert group_members(member.pid) == [member.pid]
        _kill_group(member.pid)
        assert group_members(member.pid) == [], "a process of the group was still alive when the launch returned"
    finally:
        member.kill()
        member.wait()
        member.stdout.close()


def test_kill_group_of_a_group_already_gone_returns_at_once():
    _kill_group(2**22 + 12345)  # no such group: nothing to wait for
