"""The supervisor's read loop over real pipes: events that an earlier read in the same batch consumed."""

from __future__ import annotations

import os
import subprocess
import sys

from nbaccel.launch.frames import DISPLAY_MARK, write_frame
from nbaccel.launch.handles import WorkerHandle
from nbaccel.launch.output import OutputRelay
from nbaccel.launch.supervisor import Supervisor


def test_a_display_mark_that_drains_the_control_pipe_first_does_not_break_the_loop() -> None:
    """A rank printed a display and exited: stdout's mark makes the loop read the control pipe to
    its end (closing it) before the control pipe's own event of the same batch comes up.

    Before the fix that event unregistered the closed descriptor again: ``KeyError: '14 is not
    registered'`` escaped the launch (seen once in a full CI run).
    """
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    ctl_r, ctl_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    handle = WorkerHandle(rank=0, pid=sleeper.pid, ctl_fd=ctl_r, out_fd=out_r, err_fd=err_r, popen=sleeper)
    lines: list[str] = []
    relay = OutputRelay(on_line=lambda rank, stream, line: lines.append(line))
    supervisor = Supervisor([handle], relay)
    try:
        # stdout becomes ready first, so the selector lists it before the control pipe
        os.write(out_w, b"before\n" + DISPLAY_MARK + b"after\n")
        write_frame(ctl_w, "log", {"step": 1})
        os.close(ctl_w)
        supervisor._pump(0.5)
        supervisor._pump(0.05)  # the next batch still works
        relay.flush()
        assert "before" in "".join(lines) and "after" in "".join(lines)
        assert ctl_r not in supervisor._selector.get_map()
    finally:
        sleeper.kill()
        sleeper.wait()
        for fd in (out_w, err_w):
            os.close(fd)
        supervisor._close()
