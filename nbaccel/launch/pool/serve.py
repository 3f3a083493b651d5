"""The worker side of a warm pool: join the process group once, then run task after task.

A pool worker is an ordinary worker process (:func:`~nbaccel.launch.worker.process.run_worker`, forked or
spawned by :mod:`nbaccel.launch.local.starter`) whose function is :func:`serve`: it connects to its
pool's private Unix socket, joins the process group once (``ProcessState``), says ``ready``, and
then waits. Each task (a cloudpickled ``(function, args, kwargs)``) runs through the same worker
body as every launch (:func:`~nbaccel.launch.worker.process.run_body`: ``started``, then ``result`` or
``error``), with the socket as its control channel. A task says whether its caller wants this
rank's return value; when not, the value is never pickled (only that the rank finished is sent).
What a task leaves behind stays: the process
group, the ``Accelerator``'s shared state, imported modules, and :func:`worker_namespace`.

Signals: the worker leads its own process group (as every started worker does), so a terminal's
or Jupyter's interrupt reaches only the pool's owner, which forwards it. ``SIGINT`` raises ``KeyboardInterrupt`` only
while a task's own code runs; elsewhere (reporting, waiting) it is ignored, so a cancelled task
never leaves half a message on the socket. The pool ends the worker and whatever it started
with one ``killpg``. The
worker exits when its socket reaches EOF (its owner is gone), and dies with its owner anyway
(``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Callable
from typing import Any

import cloudpickle

from nbaccel.identity import current_identity
from nbaccel.launch.frames import FrameReader, write_frame
from nbaccel.launch.payload import cpu_copies
from nbaccel.rank_lifecycle import RankLifecycle
from nbaccel.launch.worker.process import run_body

__all__ = ["serve", "worker_namespace"]

_namespace: dict[str, Any] = {"__name__": "__main__"}
# A task is armed from when it is loaded until its worker body returns, and cancellable while its
# function runs. An interrupt that lands while armed but not cancellable (the owner cancels a rank
# as soon as it said "started", a moment before the function is entered) is kept for the function.
_armed = False
_cancellable = False
_pending = False


def worker_namespace() -> dict[str, Any]:
    """This worker's namespace that persists between a pool's runs (``%%accel_launch --persist`` cells run in it).

    In a process that is not a pool worker it is simply a dict private to this process.

    Example:
        >>> def load():
        ...     worker_namespace()["model"] = "weights"   # in one run
        >>> def use():
        ...     return worker_namespace()["model"]        # in a later run, same worker
        >>> load(); use()
        'weights'
    """
    return _namespace


def _on_sigint(signum: int, frame: Any) -> None:
    global _pending
    if _cancellable:
        raise KeyboardInterrupt("interrupted by the pool's owner")
    if _armed:
        _pending = True


def _cancellable_call(function: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        global _cancellable, _pending
        _cancellable = True
        try:
            if _pending:
                _pending = False
                raise KeyboardInterrupt("interrupted by the pool's owner")
            result = function(*args, **kwargs)
        finally:
            _cancellable = False
        return cpu_copies(result)
    return call


def _next_message(sock: socket.socket, reader: FrameReader, pending: list[tuple[str, Any]]) -> tuple[str, Any] | None:
    while not pending:
        data = sock.recv(1 << 20)
        if not data:
            return None  # the pool closed its end, or its owner is gone
        pending.extend(reader.feed(data))
    return pending.pop(0)


def _load_task(payload: bytes) -> tuple[Callable[..., Any], tuple, dict]:
    """The task's ``(function, args, kwargs)``, its function made cancellable.

    A payload that does not load becomes a task that raises why, and that no cancel can pre-empt:
    every rank fails to load the same payload, and each says so (under load, the owner's cancel
    after the first rank's report used to turn the others' reports into interrupts).
    """
    try:
        function, args, kwargs = cloudpickle.loads(payload)
    except BaseException as exc:  # noqa: BLE001 - reported like the function's own failure, the pool stays
        def fail(_exc: BaseException = exc) -> None:
            raise _exc
        return fail, (), {}
    return _cancellable_call(function), args, kwargs


def serve(socket_path: str, lifecycle: RankLifecycle) -> None:
    """Be this worker's rank of the pool listening at ``socket_path`` until the pool closes.

    Raises:
        BaseException: joining the process group failed (reported as a start failure).
    """
    signal.signal(signal.SIGINT, _on_sigint)  # the starter made this worker its own group's leader
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(socket_path)
    fd = sock.fileno()
    identity = current_identity()
    write_frame(fd, "hello", identity.rank if identity is not None else 0)
    device = lifecycle.join_group()  # with CPU collectives: the group outlives any task
    write_frame(fd, "ready", {"pid": os.getpid(), "device": device})
    reader, pending = FrameReader(), list[tuple[str, Any]]()
    rank = identity.rank if identity is not None else 0
    while True:
        message = _next_message(sock, reader, pending)
        if message is None or message[0] == "close":
            sock.close()
            return
        global _armed, _pending
        payload, send_result = message[1]
        function, args, kwargs = _load_task(payload)
        signal.signal(signal.SIGINT, _on_sigint)  # an earlier task may have installed its own handler
        _armed = True
        try:
            run_body(fd, rank, identity, function, args, kwargs, send_result=send_result)
        finally:
            _armed = _pending = False
