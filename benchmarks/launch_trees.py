"""Launch overhead of two nbaccel checkouts side by side: a refactor's "before" against its "after".

Each round starts a fresh interpreter per checkout (``PYTHONPATH`` points at it; the checkouts take
turns, the first one rotating), which imports torch, then calls ``notebook_launcher`` ``--calls``
times with ``--processes`` CPU workers: an empty function, and a DDP training function (gloo, a
two-layer model, 5 steps). Reported per checkout: the first launch in the fresh process, and the
warm steady state (the median of calls 3 to ``--calls``), as medians over ``--repeat`` rounds with
their min-max spread, and the ratio of the second checkout to the first.

Run: ``.venv/bin/python benchmarks/launch_trees.py BEFORE_DIR AFTER_DIR`` (each a checkout whose
``nbaccel/`` package is measured, e.g. ``git worktree add /tmp/before <commit>``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")


def empty() -> int:
    """Nothing: its launch is the launcher's own cost."""
    return 1


def child(function: str, processes: int, calls: int) -> None:
    """In a fresh interpreter: time ``calls`` launches of ``function``; print them as JSON."""
    import torch  # noqa: F401  # a notebook has torch imported before its first launch

    from launch import ddp_train  # benchmarks/launch.py's DDP function: both benchmarks time the same work

    from nbaccel import notebook_launcher

    target = {"empty": empty, "ddp": ddp_train}[function]
    times = []
    for _ in range(calls):
        began = time.perf_counter()
        notebook_launcher(target, num_processes=processes)
        times.append(time.perf_counter() - began)
    print(json.dumps(times))


def run_child(tree: Path, function: str, processes: int, calls: int) -> list[float]:
    """One fresh interpreter measuring the checkout at ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, __file__, "--child", function, str(processes), str(calls)],
                         env=env, capture_output=True, text=True, check=True, cwd=tree)
    return json.loads(out.stdout.strip().splitlines()[-1])


def spread(values: list[float]) -> str:
    """Median with its min-max, in milliseconds."""
    return f"{statistics.median(values) * 1e3:7.0f} ms ({min(values) * 1e3:.0f}-{max(values) * 1e3:.0f})"


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="*", type=Path)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child[0], int(args.child[1]), int(args.child[2]))
    if len(args.trees) != 2:
        parser.error("give two checkouts: BEFORE_DIR AFTER_DIR")
    trees = [tree.resolve() for tree in args.trees]
    for function in ("empty", "ddp"):
        first: dict[Path, list[float]] = {tree: [] for tree in trees}
        steady: dict[Path, list[float]] = {tree: [] for tree in trees}
        for round_index in range(args.repeat):
            order = trees if round_index % 2 == 0 else trees[::-1]
            for tree in order:
                times = run_child(tree, function, args.processes, args.calls)
                first[tree].append(times[0])
                steady[tree].append(statistics.median(times[2:]))
        print(f"\n{function} function, {args.processes} CPU processes, {args.repeat} rounds "
              f"(load average {os.getloadavg()[0]:.2f})")
        for label, table in (("first launch", first), ("steady state", steady)):
            before, after = (table[tree] for tree in trees)
            ratios = [a / b for a, b in zip(after, before)]
            print(f"  {label:13s} {trees[0].name}: {spread(before)}   {trees[1].name}: {spread(after)}   "
                  f"ratio {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
