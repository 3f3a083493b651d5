"""A Ctrl-C that lands while a launch forks its workers stops the launch (it is never lost)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

# The interrupt is sent from inside the parent's after-fork callbacks, the window a real Ctrl-C
# can hit: Python prints an exception raised there as "Exception ignored" and goes on.
SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from nbaccel import notebook_launcher

    sent = []

    def interrupt_inside_the_workers_fork():
        frame, names = sys._getframe(), set()
        while frame is not None:
            names.add(frame.f_code.co_name)
            frame = frame.f_back
        if "start_forked" in names and not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)

    os.register_at_fork(after_in_parent=interrupt_inside_the_workers_fork)

    def train():
        time.sleep(4)
        return "trained"

    started = time.monotonic()
    try:
        print("RESULT", notebook_launcher(train, num_processes=2, fresh=True), flush=True)
    except KeyboardInterrupt:
        print("INTERRUPTED after %.1f s" % (time.monotonic() - started), flush=True)
    print("SENT", bool(sent), flush=True)
""")


def test_a_ctrl_c_during_the_workers_fork_stops_the_launch(tmp_path: Path) -> None:
    script = tmp_path / "launch.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                          cwd=str(Path(__file__).resolve().parents[2]))
    assert "SENT True" in done.stdout, done.stdout + done.stderr
    assert "INTERRUPTED" in done.stdout, done.stdout + done.stderr  # not "RESULT trained"
    assert "Exception ignored" not in done.stderr
