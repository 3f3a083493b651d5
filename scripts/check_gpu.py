"""Check nbaccel's CUDA paths on a machine with NVIDIA GPUs (1 or several); this repository's CI has none.

Run ``python scripts/check_gpu.py`` (or ``%run`` it in a notebook). It prints one line per
check, ``PASS|FAIL|SKIP <name> <detail>``, and exits 1 if any check failed, 2 when no GPU is
visible. Checks that need two GPUs say ``SKIP`` on one. ``--only a,b`` runs some checks;
``--dry-run [--gpus N]`` prints the plan without touching CUDA (what the CPU test suite runs).
The whole run takes 2-4 minutes on 1-8 GPUs.

Order matters: every check up to ``returned-module`` keeps CUDA untouched in this process
(work happens in launched workers, so fork stays possible); the last two query and then
initialize CUDA here on purpose, and check that launches switch to spawn and still work.

This file is the entry point; the checks live in ``scripts/gpu_checks/`` (one module per kind,
see its ``__init__``). ``scripts/check_gpu_loading.py`` goes further on loading (timings).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_checks, here and in spawned workers

from gpu_checks import CHECKS, model_checks, workers
from gpu_checks.runner import Check, Skip, expect, launch, line, run_checks

__all__ = ["CHECKS", "Check", "Skip", "expect", "launch", "line", "main", "model_checks", "run_checks", "workers"]


def main(argv: list[str] | None = None) -> int:
    """Run the checks; the exit status is 0 (all passed or skipped), 1 (a failure) or 2 (no GPU)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated check names: " + ", ".join(c.name for c in CHECKS))
    parser.add_argument("--dry-run", action="store_true", help="print the plan, touch no GPU")
    parser.add_argument("--gpus", type=int, help="with --dry-run: plan for this many GPUs")
    args = parser.parse_args(argv)
    chosen = CHECKS
    if args.only:
        names = args.only.split(",")
        unknown = sorted(set(names) - {c.name for c in CHECKS})
        if unknown:
            parser.error(f"unknown check(s) {unknown}; valid: {[c.name for c in CHECKS]}")
        chosen = [c for c in CHECKS if c.name in names]
    from nbaccel.hardware import cuda_device_count

    gpus = args.gpus if args.dry_run and args.gpus is not None else cuda_device_count()
    if gpus == 0 and not args.dry_run:
        for item in chosen:
            print(line("SKIP", item.name, "no CUDA GPU visible"))
        return 2
    counts = run_checks(chosen, gpus, dry_run=args.dry_run)
    print(f"# {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped on {gpus} GPU(s)")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
