"""The thread that starts long-lived workers: one per process, running until the process ends.

Linux's ``PR_SET_PDEATHSIG`` (how every worker dies with its owner) fires when the *thread* that
started the worker ends, not its process. A warm pool made in a short-lived thread (a
``threading.Thread``, an executor, a widget callback) would lose its workers when that thread
ended, so a pool's workers are started through :func:`on_owner_thread`: from the main thread
directly, from any other thread by this module's own daemon thread; both end only with the process.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["on_owner_thread"]

T = TypeVar("T")

_lock = threading.Lock()
_jobs: queue.SimpleQueue | None = None
_jobs_pid = 0


def _serve(jobs: queue.SimpleQueue) -> None:
    while True:
        future, function, args = jobs.get()
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(function(*args))
        except BaseException as exc:  # noqa: BLE001 - handed back to the thread that asked
            future.set_exception(exc)


def _queue() -> queue.SimpleQueue:
    global _jobs, _jobs_pid
    with _lock:
        if _jobs is None or _jobs_pid != os.getpid():  # a forked child has no such thread: start its own
            _jobs, _jobs_pid = queue.SimpleQueue(), os.getpid()
            threading.Thread(target=_serve, args=(_jobs,), name="nbaccel-owner", daemon=True).start()
        return _jobs


def on_owner_thread(function: Callable[..., T], *args: Any) -> T:
    """``function(*args)``, called from a thread that lives as long as this process.

    On the main thread it is called in place; elsewhere the calling thread waits for the owner
    thread to call it, and gets its value or its exception.

    Example:
        >>> import threading
        >>> on_owner_thread(threading.current_thread) is threading.main_thread()
        True
    """
    if threading.current_thread() is threading.main_thread():
        return function(*args)
    future: Future = Future()
    _queue().put((future, function, args))
    return future.result()
