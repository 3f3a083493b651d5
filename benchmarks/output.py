"""What a flood of worker output costs the caller, and what it sends a notebook: lines and ``\\r`` redraws.

Two tables:

1. The caller's cost, each case in a fresh process with stdout to a pipe drained by this script
   (as a terminal would be): wall time, the caller's own CPU time (its children's excluded), and
   its peak resident memory above what it held before the output began. Cases: 2 ranks printing
   ``--lines`` lines in all, and 2 ranks writing ``--redraw-mb`` MB of ``\\r`` redraws in all (as
   tqdm does, on stderr, never a newline until the end), each against the same output written by
   a plain ``print``/``write`` in the caller itself.
2. A real Jupyter kernel (its IOPub drained by this process, as a frontend would): the stream
   messages the kernel sent, the characters in them, and the time until the kernel went idle,
   for a ``notebook_launcher`` of 2 ranks printing 3,000 lines each (what took 81 s to render in
   JupyterLab), ``--lines`` lines in all, and the redraws; against a plain ``print`` loop of the
   same lines in the kernel.

Run: ``.venv/bin/python benchmarks/output.py [--lines 100000] [--redraw-mb 100]``. To measure
another checkout (before a change), put it first on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jupyter_client import BlockingKernelClient

WORKERS = """
import os

def lines(count):
    rank = int(os.environ.get("RANK", "0"))
    for i in range(count):
        print(f"rank {rank} step {i} loss {1.0 / (i + 1):.6f}")

def redraws(megabytes, write=None):
    import sys
    write = write or (lambda text: os.write(2, text.encode()))
    state, chunk = 0, []
    for state in range(megabytes * (1 << 20) // 10):
        chunk.append(f"\\r{state:9d}")
        if len(chunk) == 10_000:
            write("".join(chunk))
            chunk = []
    write("".join(chunk) + "\\n")
"""

CALLER = """
import os, resource, sys, time
sys.path.insert(0, {folder!r})
from workers import lines, redraws
from nbaccel import notebook_launcher
notebook_launcher(lines, (10,), num_processes=2)  # warm: imports, the reaper, the first fork
kind, how, amount = sys.argv[1], sys.argv[2], int(sys.argv[3])
before_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
before_cpu = time.process_time()
start = time.perf_counter()
if how == "launch":
    notebook_launcher(lines if kind == "lines" else redraws, (amount // 2,), num_processes=2)
elif kind == "lines":
    lines(amount)
else:
    redraws(amount)
sys.stdout.flush()
wall = time.perf_counter() - start
cpu = time.process_time() - before_cpu
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_rss
print(f"RESULT {{wall:.3f}} {{cpu:.3f}} {{grew / 1024:.1f}}", file=sys.stderr)
"""


def _caller_case(folder: Path, kind: str, how: str, amount: int) -> tuple[float, float, float]:
    script = folder / "caller.py"
    script.write_text(CALLER.format(folder=str(folder)))
    proc = subprocess.Popen([sys.executable, str(script), kind, how, str(amount)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    err: list[bytes] = []
    reader = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)  # type: ignore[union-attr]  # a PIPE
    reader.start()
    while proc.stdout.read(1 << 20):  # type: ignore[union-attr]  # a PIPE
        pass
    proc.wait()
    reader.join()
    text = b"".join(err).decode(errors="replace")
    result = [line for line in text.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not result:
        raise RuntimeError(f"case {kind}/{how} failed:\n{text[-3000:]}")
    wall, cpu, grew = (float(x) for x in result[-1].split()[1:])
    return wall, cpu, grew


def caller_table(folder: Path, lines: int, redraw_mb: int) -> None:
    print(f"1. The caller's cost (stdout to a pipe); {lines:,} lines and {redraw_mb} MB of redraws from 2 ranks")
    print(f"   {'case':<46} {'wall s':>8} {'caller CPU s':>13} {'peak RSS +MB':>13}")
    for kind, amount, what in (("lines", lines, f"{lines:,} lines"), ("redraws", redraw_mb, f"{redraw_mb} MB of \\r")):
        for how, label in (("launch", "notebook_launcher, 2 ranks"), ("print", "plain print in the caller")):
            wall, cpu, grew = _caller_case(folder, kind, how, amount)
            print(f"   {what + ': ' + label:<46} {wall:8.2f} {cpu:13.2f} {grew:13.1f}")


KERNEL_SETUP = """
import sys, time
sys.path.insert(0, {folder!r})
from workers import lines, redraws
from nbaccel import notebook_launcher
notebook_launcher(lines, (10,), num_processes=2)
"""


class _IOPubCounter:
    """Drains the kernel's IOPub; counts stream messages and characters per request, notes idle."""

    def __init__(self, client: BlockingKernelClient) -> None:
        self.client = client
        self.counts: dict[str, list[int]] = {}
        self.idle: dict[str, float] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        while not self.stop.is_set():
            try:
                msg = self.client.get_iopub_msg(timeout=0.2)
            except Exception:  # noqa: BLE001 - queue.Empty between messages
                continue
            parent = msg["parent_header"].get("msg_id", "")
            if msg["msg_type"] == "stream":
                count = self.counts.setdefault(parent, [0, 0])
                count[0] += 1
                count[1] += len(msg["content"]["text"])
            elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                self.idle[parent] = time.perf_counter()

    def run(self, code: str, timeout: float = 1800) -> tuple[int, int, float]:
        start = time.perf_counter()
        msg_id = self.client.execute(code, store_history=False)
        deadline = time.monotonic() + timeout
        while msg_id not in self.idle:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the kernel did not finish {code!r}")
            time.sleep(0.01)
        messages, chars = self.counts.get(msg_id, [0, 0])
        return messages, chars, self.idle[msg_id] - start


def kernel_table(folder: Path, lines: int, redraw_mb: int) -> None:
    from jupyter_client.manager import start_new_kernel

    env = dict(os.environ, OMP_NUM_THREADS="1", NBACCEL_CONFIG_FILE=str(folder / "cfg.yaml"))
    km, client = start_new_kernel(kernel_name="python3", env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
    counter = _IOPubCounter(client)
    try:
        counter.run(KERNEL_SETUP.format(folder=str(folder)))
        print("2. A real kernel's IOPub: stream messages sent, characters in them, seconds until idle")
        print(f"   {'case':<58} {'messages':>9} {'chars':>12} {'to idle s':>10}")
        cases = [("2 ranks x 3,000 lines: notebook_launcher", "notebook_launcher(lines, (3000,), num_processes=2)"),
                 ("6,000 lines: plain print in the kernel", "lines(6000)"),
                 (f"{lines:,} lines from 2 ranks: notebook_launcher",
                  f"notebook_launcher(lines, ({lines // 2},), num_processes=2)"),
                 (f"{lines:,} lines: plain print in the kernel", f"lines({lines})"),
                 (f"{redraw_mb} MB of \\r from 2 ranks: notebook_launcher",
                  f"notebook_launcher(redraws, ({redraw_mb // 2},), num_processes=2)"),
                 (f"{redraw_mb} MB of \\r: plain write in the kernel", f"redraws({redraw_mb}, sys.stderr.write)")]
        for label, code in cases:
            messages, chars, took = counter.run(code)
            print(f"   {label:<58} {messages:9,} {chars:12,} {took:10.2f}")
    finally:
        counter.stop.set()
        client.stop_channels()
        km.shutdown_kernel(now=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--redraw-mb", type=int, default=100)
    parser.add_argument("--skip-kernel", action="store_true")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="nbaccel-output-bench-"))
    (folder / "workers.py").write_text(textwrap.dedent(WORKERS))
    import nbaccel

    print(f"nbaccel from {Path(nbaccel.__file__).parent}; load average {os.getloadavg()[0]:.2f}")
    try:
        caller_table(folder, args.lines, args.redraw_mb)
        if not args.skip_kernel:
            kernel_table(folder, args.lines, args.redraw_mb)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
