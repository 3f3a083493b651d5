"""Functions the background-run tests run in workers (importable, so spawned workers and pools find them)."""

from __future__ import annotations

import os
import time


def count_and_log(steps: int, pause: float = 0.05) -> int:
    """Print and ``accelerator.log`` one line per step; the world size times 10."""
    from nbaccel import Accelerator

    accelerator = Accelerator()
    for step in range(steps):
        print(f"step {step} of rank {accelerator.process_index}", flush=True)
        accelerator.log({"loss": 1.0 / (step + 1)}, step=step)
        time.sleep(pause)
    return accelerator.num_processes * 10


def fail_on_rank_one() -> int:
    """Rank 1 raises ``KeyError('missing')``; rank 0 waits to be stopped."""
    if int(os.environ.get("RANK", "0")) == 1:
        raise KeyError("missing")
    time.sleep(30)
    return 0


def sleep_and_say(marker_dir: str, seconds: float = 60) -> int:
    """Write ``pid-<rank>`` with this worker's pid (and of a child it starts), then sleep."""
    import subprocess

    child = subprocess.Popen(["sleep", str(seconds)])  # a grandchild that must not outlive it
    rank = os.environ.get("RANK", "0")
    with open(os.path.join(marker_dir, f"pid-{rank}"), "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    time.sleep(seconds)
    return 1


def print_lines(count: int, width: int) -> int:
    """Print ``count`` numbered lines of ``width`` characters."""
    for i in range(count):
        print(f"{i:08d}" + "x" * (width - 8), flush=i % 100 == 0)
    return count
