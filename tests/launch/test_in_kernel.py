"""notebook_launcher inside a real Jupyter kernel: functions from cells, output, the kernel's Interrupt."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest
from jupyter_client.manager import start_new_kernel

from .procs import alive


@pytest.fixture()
def kernel(monkeypatch, tmp_path):
    monkeypatch.setenv("JUPYTER_PATH", str(Path(sys.prefix) / "share" / "jupyter"))
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(tmp_path))
    try:
        yield km, kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def run(kc, code: str, timeout: float = 120) -> tuple[str, str, list[dict]]:
    """Execute ``code``; return (stdout, stderr, error contents)."""
    msg_id = kc.execute(textwrap.dedent(code))
    return collect(kc, msg_id, timeout)


def collect(kc, msg_id: str, timeout: float) -> tuple[str, str, list[dict]]:
    out, err, errors = [], [], []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            (out if content["name"] == "stdout" else err).append(content["text"])
        elif kind == "error":
            errors.append(content)
        elif kind == "status" and content["execution_state"] == "idle":
            break
    return "".join(out), "".join(err), errors


def test_function_from_a_cell_runs_and_prints_labelled_lines(kernel):
    _, kc = kernel
    run(kc, """
        from nbaccel import notebook_launcher
        SCALE = 3
        def train(x):
            import os
            print("rank", os.environ["RANK"], "says hi")
            return x * SCALE
    """)
    out, _err, errors = run(kc, "print('result', notebook_launcher(train, (2,), num_processes=2))")
    assert not errors, errors
    assert "[rank0]: rank 0 says hi" in out and "[rank1]: rank 1 says hi" in out
    assert "result 6" in out
    lines = [line for line in out.splitlines() if line]
    assert all(line.startswith("[rank") or line.startswith("result") for line in lines), lines


def test_kernel_interrupt_stops_workers_and_the_kernel_stays_usable(kernel, tmp_path):
    km, kc = kernel
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    run(kc, f"""
        import os, time
        from nbaccel import notebook_launcher
        def sleeper():
            open(os.path.join({str(pid_dir)!r}, str(os.getpid())), "w").close()
            time.sleep(120)
    """)
    msg_id = kc.execute("notebook_launcher(sleeper, num_processes=3)")
    deadline = time.monotonic() + 60
    while len(os.listdir(pid_dir)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = [int(p) for p in os.listdir(pid_dir)]
    assert len(pids) == 3
    sent = time.monotonic()
    km.interrupt_kernel()
    _, _, errors = collect(kc, msg_id, 30)
    assert time.monotonic() - sent < 5
    assert errors and errors[0]["ename"] == "KeyboardInterrupt"
    assert not any(alive(p) for p in pids)
    out, _, errors = run(kc, "print('again', notebook_launcher(lambda: 41 + 1, num_processes=2))")
    assert not errors and "again 42" in out


def test_failure_in_a_cell_function_shows_the_remote_traceback(kernel):
    _, kc = kernel
    _, _, errors = run(kc, """
        from nbaccel import notebook_launcher
        def broken():
            import os
            if os.environ["RANK"] == "1":
                raise KeyError("missing column")
        notebook_launcher(broken, num_processes=2)
    """)
    assert errors and errors[0]["ename"] == "KeyError"
    shown = "\n".join(errors[0]["traceback"])
    assert "RemoteTraceback" in shown and 'raise KeyError("missing column")' in shown
    assert "root cause: rank 1" in shown
