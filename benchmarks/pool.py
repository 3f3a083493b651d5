"""Warm workers against cold launches: what a cell costs when the workers are already up.

Two tables, every figure a median [min..max] over ``--rounds`` interleaved rounds, with ratios:

1. Round trip of a trivial cell on 4 CPU workers (goal: a persisted cell <= 20 ms): a
   ``WorkerPool.run`` and a ``%%accel_launch --persist`` cell (in an in-process IPython shell, no
   status panel) against a cold ``notebook_launcher``, a cold ``%%accel_launch -n 4`` cell, and
   Accelerate's ``notebook_launcher``.
2. "Load a model, then 5 cells that each run a forward", on 2 CPU workers: a warm pool (its start
   included) against 5 cold nbaccel launches and 5 of Accelerate's, each cold launch loading the
   model again. The model is a stack of Linear layers saved as safetensors (``--model-mb``,
   default 256; the issue's 1 GB is ``--model-mb 1024`` on a machine with the memory for it).

Run: ``.venv/bin/python benchmarks/pool.py`` (``pip install accelerate`` for its column; without it
the column is skipped). CPU time on this machine is shared: the load average is printed too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from nbaccel import WorkerPool, notebook_launcher, worker_namespace

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

WIDTH = 4096  # one Linear(4096, 4096) is 64 MiB of fp32 weights


def trivial() -> int:
    """A function that does nothing: its round trip is pure overhead."""
    return 1


def _spread(values: list[float], digits: int = 4) -> str:
    return (f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}..{max(values):.{digits}f}]")


def _timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _accelerate_launcher() -> Callable[..., object] | None:
    try:
        from accelerate import notebook_launcher as theirs
    except ImportError:
        return None
    return theirs


def _shell() -> InteractiveShell:  # an in-process IPython shell with nbaccel's magics
    from IPython.testing import globalipapp

    globalipapp.start_ipython()
    shell = globalipapp.get_ipython()
    shell.run_line_magic("load_ext", "nbaccel")
    return shell


def _cell(shell: InteractiveShell, source: str) -> Callable[[], None]:
    def run() -> None:
        shell.run_cell(source).raise_error()
    return run


def round_trips(rounds: int, calls: int) -> None:
    """Table 1: a trivial cell's round trip on 4 CPU workers."""
    shell = _shell()
    shell.run_line_magic("accel_workers", "start -n 4 --cpu")
    magics = shell.magics_manager.registry["AccelMagics"]
    pool = magics.workers.pool
    theirs = _accelerate_launcher()
    cases: dict[str, Callable[[], object]] = {
        "WorkerPool.run": lambda: pool.run(trivial),
        "%%accel_launch --persist": _cell(shell, "%%accel_launch --persist --status none\nx = 1\n"),
        "notebook_launcher (cold)": lambda: notebook_launcher(trivial, num_processes=4, use_cpu=True),
        "%%accel_launch -n 4 (cold)": _cell(shell, "%%accel_launch -n 4 --cpu --status none\nx = 1\n"),
    }
    if theirs is not None:
        cases["accelerate notebook_launcher"] = lambda: theirs(trivial, num_processes=4)
    for run in cases.values():
        run()  # first calls pay one-time imports
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, run in cases.items():
            warm = "cold" not in name and "accelerate" not in name
            times[name].append(statistics.median(_timed(run) for _ in range(calls)) if warm else _timed(run))
    shell.run_line_magic("accel_workers", "stop")
    base = times["%%accel_launch --persist"]
    print(f"\ntrivial cell, 4 CPU workers: seconds, median [min..max] of {rounds} rounds (warm: median of {calls} "
          f"calls per round); ratio = case / persisted cell; goal: persisted cell <= 0.020 s")
    print(f"{'case':30} {'seconds':>28} {'ratio to --persist':>22}")
    for name, values in times.items():
        ratios = [v / b for v, b in zip(values, base)]
        print(f"{name:30} {_spread(values):>28} {_spread(ratios, 1):>22}")


class Model(torch.nn.Module):
    """``layers`` Linear(WIDTH, WIDTH) with ReLU between."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def load(path: str, layers: int) -> Model:
    """Read the checkpoint into a fresh model (what a notebook's slow first cell does)."""
    from safetensors.torch import load_file

    model = Model(layers)
    model.load_state_dict(load_file(path))
    return model.eval()


def forward(model: Model) -> float:
    with torch.no_grad():
        return float(model(torch.ones(8, WIDTH)).sum())


def load_into_namespace(path: str, layers: int) -> None:
    worker_namespace()["model"] = load(path, layers)


def forward_from_namespace() -> float:
    return forward(worker_namespace()["model"])


def load_and_forward(path: str, layers: int) -> float:
    return forward(load(path, layers))


def model_cells(rounds: int, model_mb: int, cells: int = 5) -> None:
    """Table 2: load once then ``cells`` forwards, warm against cold."""
    from safetensors.torch import save_file

    layers = max(1, round(model_mb / 64))
    folder = Path(tempfile.mkdtemp(prefix="nbaccel-bench-"))
    path = str(folder / "model.safetensors")
    save_file(Model(layers).state_dict(), path)
    theirs = _accelerate_launcher()

    def warm() -> None:
        with WorkerPool(num_processes=2, use_cpu=True) as pool:
            pool.run(load_into_namespace, path, layers)
            for _ in range(cells):
                pool.run(forward_from_namespace)

    def cold() -> None:
        for _ in range(cells):
            notebook_launcher(load_and_forward, (path, layers), num_processes=2, use_cpu=True)

    cases: dict[str, Callable[[], None]] = {"warm pool (start + load + 5 cells)": warm, "5 cold nbaccel launches": cold}
    if theirs is not None:
        cases["5 accelerate launches"] = lambda: [theirs(load_and_forward, (path, layers), num_processes=2)
                                                  for _ in range(cells)]
    times: dict[str, list[float]] = {name: [] for name in cases}
    try:
        for _ in range(rounds):
            for name, run in cases.items():
                times[name].append(_timed(run))
    finally:
        os.remove(path)
        folder.rmdir()
    base = times["warm pool (start + load + 5 cells)"]
    print(f"\nload a {layers * 64} MiB model, then {cells} cells with one forward each, 2 CPU workers: seconds, "
          f"median [min..max] of {rounds} rounds; ratio = case / warm pool")
    print(f"{'case':36} {'seconds':>26} {'ratio to warm':>20}")
    for name, values in times.items():
        print(f"{name:36} {_spread(values, 2):>26} {_spread([v / b for v, b in zip(values, base)], 2):>20}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per table")
    parser.add_argument("--calls", type=int, default=20, help="warm calls per round in table 1")
    parser.add_argument("--model-mb", type=int, default=256, help="model size for table 2 (MiB)")
    parser.add_argument("--only", choices=("trips", "model"), default=None, help="run one table")
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, load average {os.getloadavg()[0]:.2f}")
    if args.only in (None, "trips"):
        round_trips(args.rounds, args.calls)
    if args.only in (None, "model"):
        model_cells(max(1, args.rounds // 2), args.model_mb)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
