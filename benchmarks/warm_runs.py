"""A warm rank's own share of a launch: what one fresh run costs in the rank, and after a run imported a library.

Each case runs ``fresh_task.run_fresh`` in a new interpreter that has imported torch and frozen its
objects (as a forked rank inherits them), so the figures are the rank's work alone: putting the
caller's state in place, running a trivial function, and clearing what it left (descendants,
threads, signal handlers, limits, logging, the garbage collection). Rows: a trivial run; a trivial
run after an earlier run imported ``transformers`` (the collection walks what that import made
unless it is frozen). Medians with [min..max] over ``--repeat`` fresh processes of ``--runs`` runs.

Run: ``.venv/bin/python benchmarks/warm_runs.py`` (the second row needs transformers installed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _child(case: str, runs: int) -> None:
    import gc

    import torch  # noqa: F401 - the caller's import, frozen in a forked rank

    gc.freeze()
    from nbaccel.launch.payload import dumps_payload
    import cloudpickle

    from nbaccel.launch.pool.fresh_task import run_fresh, snapshot_caller
    from nbaccel.rank_lifecycle import RankLifecycle

    snapshot = snapshot_caller({"RANK": "0"})
    lifecycle = cloudpickle.dumps(RankLifecycle())
    trivial = dumps_payload(int, (), {})
    if case == "after importing transformers":
        run_fresh(snapshot, dumps_payload(__import__, ("transformers.modeling_utils",), {}), lifecycle)
    for _ in range(3):
        run_fresh(snapshot, trivial, lifecycle)
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        run_fresh(snapshot, trivial, lifecycle)
        times.append(time.perf_counter() - began)
    print(json.dumps(statistics.median(times)))


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _child(args.child[0], int(args.child[1]))
    print(f"fresh run of a trivial function in the rank (ms, median [min..max] of {args.repeat} processes, "
          f"each the median of {args.runs} runs; load {os.getloadavg()[0]:.2f})")
    for case in ("trivial", "after importing transformers"):
        got = []
        for _ in range(args.repeat):
            done = subprocess.run([sys.executable, __file__, "--child", case, str(args.runs)], capture_output=True,
                                  text=True, timeout=600)
            if done.returncode != 0:
                print(f"{case:32} failed: {done.stderr.strip().splitlines()[-1:]}")
                break
            got.append(json.loads(done.stdout) * 1e3)
        if got:
            print(f"{case:32} {statistics.median(got):6.3f} [{min(got):.3f}..{max(got):.3f}]")


if __name__ == "__main__":
    main()
