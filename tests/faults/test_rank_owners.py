"""Ranks belong to the process that started them: a forked child of the caller never touches them.

Rows of issue 33: a child forked from the caller (``os.fork``, ``multiprocessing`` with fork) that
exits normally used to shut the caller's warm rank and pool down (their finalizers ran in the
child at its exit), and a launch in the child failed with ``EBADF`` (the rank's sockets are closed
in every forked child). Each case runs in its own interpreter, as a notebook kernel would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_CALLER = """
    import json, multiprocessing, os, sys
    from nbaccel import WorkerPool, notebook_launcher
    from nbaccel.errors import WorkerPoolError

    def pid():
        return os.getpid()

    def launch_one():
        return notebook_launcher(pid, num_processes=1, use_cpu=True, timeout=120)

    def in_child(how, write_fd, pool):
        seen = {"own_launch": launch_one()}
        try:
            pool.run(pid)
            seen["pool_run"] = "ran"
        except WorkerPoolError as exc:
            seen["pool_run"] = [exc.state, str(exc)]
        seen["pool_alive_here"] = pool.alive
        os.write(write_fd, json.dumps(seen).encode())
        os.close(write_fd)
        # then leave normally: the interpreter's exit runs atexit and finalizers, as a user's child does

    how = sys.argv[1]
    pool = WorkerPool(num_processes=2, use_cpu=True, start_method="fork")
    report = {"warm": launch_one(), "pool": pool.pids}
    read_fd, write_fd = os.pipe()
    if how == "os.fork":
        child = os.fork()
        if child == 0:
            os.close(read_fd)
            in_child(how, write_fd, pool)
            sys.exit(0)
        os.waitpid(child, 0)
    else:
        process = multiprocessing.get_context("fork").Process(target=in_child, args=(how, write_fd, pool))
        process.start()
        process.join()
    os.close(write_fd)
    with os.fdopen(read_fd) as reader:
        report["child"] = json.loads(reader.read())
    report["warm_after"] = launch_one()
    report["pool_after"] = sorted(pool.run(pid, return_all=True).values())
    report["pool_alive"] = pool.alive
    pool.close()
    print("REPORT", json.dumps(report), flush=True)
"""


@pytest.mark.parametrize("how", ["os.fork", "multiprocessing"])
def test_a_forked_child_launches_on_its_own_ranks_and_its_exit_leaves_the_callers(tmp_path, how):
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(_CALLER))
    done = subprocess.run([sys.executable, str(script), how], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    assert done.returncode == 0 and lines, done.stdout + done.stderr
    report = json.loads(lines[0].removeprefix("REPORT "))
    child = report["child"]
    assert report["warm_after"] == report["warm"]  # the caller's warm rank outlived the child's exit
    assert report["pool_after"] == sorted(report["pool"]) and report["pool_alive"]
    assert child["own_launch"] not in (report["warm"], *report["pool"])  # the child started its own rank
    assert child["pool_run"][0] == "not owned" and "Fix:" in child["pool_run"][1]
    assert child["pool_alive_here"] is False
