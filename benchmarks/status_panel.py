"""What following a launch costs: the live status panel and the %%accel_launch magic, in a real kernel.

Inside one Jupyter kernel (its IOPub drained by this process, as a frontend would), the same
2-process function that prints ``--lines`` lines per rank is launched by:

- ``notebook_launcher(fn)`` with no observer (the baseline),
- ``notebook_launcher(fn, observer=StatusPanel(...))`` (the widget panel, comm messages sent),
- a ``%%accel_launch -n 2`` cell (config layers, cell compilation, panel, -o and result),
- Accelerate's ``notebook_launcher(fn, num_processes=2)`` (the peer, when installed).

Runs alternate; we print the median wall time of each and its ratio to the baseline.

Run: ``.venv/bin/python benchmarks/status_panel.py [--repeat 7] [--lines 2000]``
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from jupyter_client.manager import start_new_kernel

if TYPE_CHECKING:
    from jupyter_client import BlockingKernelClient

SETUP = """
import time, statistics, importlib.util
from nbaccel import notebook_launcher
from nbaccel.widgets.status_panel import StatusPanel
get_ipython().run_line_magic("load_ext", "nbaccel")
LINES = {lines}
def work(lines=LINES):
    for i in range(lines):
        print(f"step {{i}} loss {{1.0 / (i + 1):.4f}}")
    return 1
HAVE_ACCELERATE = importlib.util.find_spec("accelerate") is not None
CELL = "for i in range(LINES):\\n    print(f'step {{i}}')\\n1\\n"
def timed(fn):
    start = time.perf_counter(); fn(); return time.perf_counter() - start
runs = {{"baseline": [], "panel": [], "magic": [], "accelerate": []}}
inside = []
class Timed:
    # forwards to a StatusPanel and adds up the time spent in its (inline) callbacks
    def __init__(self, panel):
        self.panel, self.spent, self.by_name = panel, 0.0, {{}}
    def __getattr__(self, name):
        method = getattr(self.panel, name)
        def call(*a):
            start = time.perf_counter(); method(*a); took = time.perf_counter() - start
            self.spent += took; self.by_name[name] = self.by_name.get(name, 0.0) + took
        return call
def with_panel():
    observer = Timed(StatusPanel(2))
    notebook_launcher(work, num_processes=2, observer=observer)
    inside.append((observer.spent, observer.by_name))
"""

ROUND = """
runs["baseline"].append(timed(lambda: notebook_launcher(work, num_processes=2)))
runs["panel"].append(timed(with_panel))
runs["magic"].append(timed(lambda: get_ipython().run_cell_magic("accel_launch", "-n 2 --status widget", CELL)))
if HAVE_ACCELERATE:
    import accelerate
    runs["accelerate"].append(timed(lambda: accelerate.notebook_launcher(work, num_processes=2)))
"""

REPORT = """
base = statistics.median(runs["baseline"])
print("RESULT  what                                   median s   ratio to baseline")
for key, label in [("baseline", "nbaccel notebook_launcher, no observer"),
                   ("panel", "nbaccel notebook_launcher + StatusPanel"),
                   ("magic", "%%accel_launch -n 2 (widget panel)"),
                   ("accelerate", "accelerate.notebook_launcher (peer)")]:
    if runs[key]:
        m = statistics.median(runs[key])
        print(f"RESULT  {label:<38} {m:8.3f}   {m / base:6.2f}x")
spent = statistics.median(t for t, _ in inside)
print(f"RESULT  time inside the panel's callbacks: median {spent * 1000:.1f} ms per launch "
      f"({spent / base * 100:.2f}% of the baseline launch); by callback (ms): "
      + ", ".join(f"{k} {statistics.median(b[k] for _, b in inside) * 1000:.1f}" for k in inside[0][1]))
"""


def _drain(client: BlockingKernelClient, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            client.get_iopub_msg(timeout=0.2)
        except Exception:  # noqa: BLE001 - queue.Empty between messages
            continue


def _execute(client: BlockingKernelClient, code: str, timeout: float = 600) -> None:
    """Run ``code`` in the kernel and wait for it to finish."""
    msg_id = client.execute(code, store_history=False)
    reply = client.get_shell_msg(timeout=timeout)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = client.get_shell_msg(timeout=timeout)
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"benchmark cell failed: {reply['content'].get('evalue')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--lines", type=int, default=2000)
    args = parser.parse_args()
    out_file = Path(tempfile.mkdtemp()) / "report.txt"
    env = dict(os.environ, OMP_NUM_THREADS="1", NBACCEL_CONFIG_FILE=str(out_file.with_name("cfg.yaml")))
    km, client = start_new_kernel(kernel_name="python3", env=env)
    stop = threading.Event()
    drainer = threading.Thread(target=_drain, args=(client, stop), daemon=True)
    drainer.start()
    try:
        _execute(client, SETUP.format(lines=args.lines))
        _execute(client, ROUND)  # warm-up round: imports, first fork
        _execute(client, "runs = {k: [] for k in runs}; inside.clear()")
        for _ in range(args.repeat):
            _execute(client, ROUND)
        _execute(client, "import contextlib, io\nbuf = io.StringIO()\nwith contextlib.redirect_stdout(buf):\n"
                 + "\n".join("    " + line for line in REPORT.strip().splitlines())
                 + f"\nopen({str(out_file)!r}, 'w').write(buf.getvalue())\n")
        print(f"{args.repeat} alternating rounds, 2 processes, {args.lines} lines per rank, in a real kernel")
        print(out_file.read_text().replace("RESULT  ", ""), end="")
    finally:
        stop.set()
        client.stop_channels()
        km.shutdown_kernel(now=True)


if __name__ == "__main__":
    main()
