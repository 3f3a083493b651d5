"""Restarting a failed single-machine launch, as ``notebook_launcher(..., max_restarts=N)`` does in Accelerate.

On one machine nbaccel launches again itself (on several, torch's elastic agent restarts): a launch
whose worker failed is run again, up to ``max_restarts`` more times. Timeouts and interrupts are not.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from nbaccel.errors import ConfigError, WorkerFailedError

__all__ = ["check_max_restarts", "run_with_restarts"]


def check_max_restarts(max_restarts: object) -> int:
    """``max_restarts`` if it is an int >= 0.

    Raises:
        ConfigError: it is not.
    """
    if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
        raise ConfigError(f"`max_restarts` must be an int >= 0 (got {max_restarts!r}). Fix: pass e.g. max_restarts=1 "
                          "to run a failed launch once more.", key="max_restarts", value=max_restarts, valid="int >= 0")
    return max_restarts


def run_with_restarts(run: Callable[[], Any], max_restarts: int) -> Any:
    """``run()``, run again after a worker failure, at most ``max_restarts`` more times.

    Returns:
        What the first successful run returned.

    Raises:
        WorkerFailedError: the last run's failure, when every run failed.

    Example:
        >>> run_with_restarts(lambda: 1, max_restarts=2)
        1
    """
    for attempt in range(check_max_restarts(max_restarts) + 1):
        try:
            return run()
        except Exception as exc:
            # A worker's RuntimeError cannot be joined with WorkerFailedError (a RuntimeError itself),
            # so it comes back as itself carrying `launch_failures`.
            if attempt == max_restarts or not (isinstance(exc, WorkerFailedError) or hasattr(exc, "launch_failures")):
                raise
            print(f"[nbaccel] launch failed ({type(exc).__name__}); restarting it "
                  f"({attempt + 1} of {max_restarts} restarts)", file=sys.stderr)
    raise AssertionError("unreachable")
