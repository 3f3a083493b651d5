"""What a GPU check is, and running checks in order: one ``PASS|FAIL|SKIP <name> <detail>`` line each.

A check is a function of the number of GPUs that returns a detail string, raises :class:`Skip`
when it cannot run here, or fails (any other exception, :func:`expect` included). A failing
check is reported and the next one still runs; only ``SystemExit`` and ``KeyboardInterrupt``
stop the run (except in the ``interrupt`` check, which provokes one).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["LAUNCH_TIMEOUT", "Check", "Skip", "expect", "launch", "line", "registrar", "run_checks"]

LAUNCH_TIMEOUT = 150.0


class Skip(Exception):
    """Raised by a check that cannot run here (its message says why)."""


@dataclass(frozen=True)
class Check:
    """One named check: ``run(gpus)`` returns a detail string, raises :class:`Skip`, or fails."""

    name: str
    run: Callable[[int], str]
    min_gpus: int = 1


Register = Callable[[Callable[[int], str]], Callable[[int], str]]


def registrar(checks: list[Check]) -> Callable[..., Register]:
    """A ``@check(name, min_gpus=1)`` decorator that appends to ``checks``, in definition order.

    Example:
        >>> CHECKS: list[Check] = []
        >>> check = registrar(CHECKS)
        >>> @check("nothing")
        ... def _nothing(gpus: int) -> str:
        ...     return "done"
        >>> [c.name for c in CHECKS]
        ['nothing']
    """
    def check(name: str, min_gpus: int = 1) -> Register:
        def register(function: Callable[[int], str]) -> Callable[[int], str]:
            checks.append(Check(name, function, min_gpus))
            return function
        return register
    return check


def line(status: str, name: str, detail: object = "") -> str:
    """The one line a check prints: ``STATUS name detail`` on one line."""
    text = " ".join(str(detail).split())
    return f"{status} {name} {text[:400]}".rstrip()


def run_checks(checks: list[Check], gpus: int, *, dry_run: bool = False,
               out: Callable[[str], None] = print) -> dict[str, int]:
    """Run ``checks`` in order on ``gpus`` GPUs, printing one line each; returns the count of each status."""
    counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
    for item in checks:
        start = time.monotonic()
        if item.min_gpus > gpus:
            status, detail = "SKIP", f"needs {item.min_gpus}+ GPUs (have {gpus})"
        elif dry_run:
            status, detail = "SKIP", f"dry run (would run on {gpus} GPU(s))"
        else:
            try:
                status, detail = "PASS", item.run(gpus)
            except Skip as skip:
                status, detail = "SKIP", str(skip)
            except BaseException as exc:  # a failed check is reported, the next one runs
                if isinstance(exc, (SystemExit, KeyboardInterrupt)) and item.name != "interrupt":
                    raise
                status, detail = "FAIL", f"{type(exc).__name__}: {exc}"
        took = "" if dry_run or status == "SKIP" else f" ({time.monotonic() - start:.1f}s)"
        out(line(status, item.name, f"{detail}{took}"))
        counts[status] += 1
    return counts


def expect(condition: bool, message: object) -> None:
    """Fail the current check with ``message`` unless ``condition`` holds."""
    if not condition:
        raise AssertionError(str(message))


def launch(function: Callable[..., Any], *args: Any, n: int, **options: Any) -> dict[int, Any]:
    """Every rank's result; workers' output is hidden (errors still come back)."""
    from nbaccel import notebook_launcher

    return notebook_launcher(function, args, num_processes=n, return_all=True, timeout=LAUNCH_TIMEOUT,
                             output_ranks=(), **options)
