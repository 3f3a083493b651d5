"""Functions the pool tests run in workers (importable, so spawned workers find them too), and waiting helpers."""

from __future__ import annotations

import os
import time
from collections.abc import Callable


def wait_for(predicate: Callable[[], bool], timeout: float) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def pid_and_rank() -> tuple[int, int]:
    """This worker's pid and rank."""
    return os.getpid(), int(os.environ["RANK"])


def remember(name: str, value: object) -> None:
    """Keep ``value`` in this worker's persistent namespace."""
    from nbaccel import worker_namespace

    worker_namespace()[name] = value


def recall(name: str) -> object:
    """What :func:`remember` kept."""
    from nbaccel import worker_namespace

    return worker_namespace()[name]


def sleep_until_cancelled(marker_dir: str, seconds: float = 60) -> None:
    """Write a 'running' marker, sleep; on KeyboardInterrupt write a 'cancelled' marker and re-raise."""
    rank = os.environ["RANK"]
    open(os.path.join(marker_dir, f"running-{rank}"), "w").close()
    try:
        time.sleep(seconds)
    except KeyboardInterrupt:
        open(os.path.join(marker_dir, f"cancelled-{rank}"), "w").close()
        raise


def _explode() -> None:
    raise ValueError("this object cannot be rebuilt in a worker")


class LoadsNowhere:
    """Pickles fine; unpickling raises (as an object of a module the workers lack would)."""

    def __reduce__(self):
        return (_explode, ())
