"""Warm one-process ranks: a repeated one-process launch runs on a rank kept per kernel, and sees a fresh run.

On one GPU (Colab), every ``notebook_launcher(fn, num_processes=1)`` used to fork a worker that
set CUDA up again: 0.8 s, against Accelerate's in-process call of 0.03 s. The ``"warm"`` launcher
keeps one rank (a one-member pool, :mod:`nbaccel.launch.pool.local_ranks`) per kernel and per
settings, and runs each launch on it as a fresh run (:mod:`nbaccel.launch.pool.fresh_task`),
supervised as every launch is; a payload that will not pickle goes to the local launcher (a fork).

The rank is closed after any failure or interrupt (a CUDA error sticks to its context), when a
run left what cannot be undone in place, when a user module it may have imported changed on disk,
after :data:`IDLE_CLOSE_SECONDS` unused, when another launch or a pool needs its GPU, at
``%accel_workers stop``, and at interpreter exit. The rank belongs to the process that started it:
a forked child of the caller forgets it and never closes it. Where a warm run differs from a fresh
process on purpose: docs/architecture.md, Lifetimes.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from nbaccel.errors import PayloadPicklingError
from nbaccel.launch.backend import Backend
from nbaccel.launch.claims import WARM_RANK, cancel_holders
from nbaccel.launch.local.launcher import LAUNCHER as LOCAL_LAUNCHER
from nbaccel.launch.local.starter import local_environments
from nbaccel.launch.payload import dumps_payload
from nbaccel.launch.pool.fresh_task import FreshResult, run_fresh, snapshot_caller
from nbaccel.launch.pool.local_ranks import LocalPoolRanks
from nbaccel.launch.pool.user_modules import changed_since, user_module_files
from nbaccel.launch.request import LaunchRequest
from nbaccel.launch.supervised_run import Lifetime, SupervisedRun
from nbaccel.launch.warmup import prepare_to_fork

__all__ = ["BACKEND", "IDLE_CLOSE_SECONDS", "LAUNCHER", "WarmLauncher", "WarmRankInfo", "close_warm_rank",
           "release_warm_devices", "warm_rank_info"]

IDLE_CLOSE_SECONDS = 300.0
"""A warm rank unused this long is closed (its memory, and its GPU context, go back)."""
START_TIMEOUT = 300.0


@dataclass(frozen=True)
class WarmRankInfo:
    """The kept rank, as ``%accel_workers`` shows it.

    Attributes:
        pid: its process.
        device: ``"cpu"`` or ``"cuda:0"``.
        start_method: ``"fork"`` or ``"spawn"``.
        idle_seconds: since its last run ended.
        runs: launches it ran.
    """

    pid: int
    device: str
    start_method: str
    idle_seconds: float
    runs: int


@dataclass
class _WarmRank:
    key: tuple[Any, ...]
    ranks: LocalPoolRanks
    device_kind: str
    start_method: str
    started_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    runs: int = 0
    rank_files: dict[str, float] = field(default_factory=dict)  # user modules runs imported -> when that run began
    closed: threading.Event = field(default_factory=threading.Event)
    finalizer: weakref.finalize | None = None
    owner: int = field(default_factory=os.getpid)  # a forked child (a pool rank, say) inherits it, never owns it

    def close(self) -> None:
        self.closed.set()  # its idle watcher ends
        if self.finalizer is not None:
            self.finalizer()  # shuts the rank down once (also at interpreter exit)


_lock = threading.RLock()  # guards _warm; held for a whole run, so the idle timer never closes a busy rank
_warm: _WarmRank | None = None
_INHERITED: list[_WarmRank] = []


def _forget_inherited() -> None:
    """In a process forked from the rank's owner, forget the owner's rank without touching it.

    Its sockets and pipes are the owner's; their numbers may already be reused here (by a process
    group's sockets): closing them, or letting them be collected, would close those. The record is
    kept referenced, its finalizer detached, and a launch here starts a rank of its own.
    """
    global _warm
    if _warm is not None and _warm.owner != os.getpid():
        if _warm.finalizer is not None:
            _warm.finalizer.detach()
        _INHERITED.append(_warm)
        _warm = None


def _forget_in_child() -> None:
    """In a forked child: the kept rank is the parent's (its sockets are closed here); a launch here starts its own."""
    global _lock, _warm
    _lock = threading.RLock()  # another thread may have held it at the fork: it never lets go here
    _warm = None  # its finalizer runs here and does nothing: the ranks' processes stop only in their owner


os.register_at_fork(after_in_child=_forget_in_child)


class WarmLauncher:
    """Runs a one-process request on the kept rank (see the module docstring)."""

    name = "warm"

    def launch(self, request: LaunchRequest) -> dict[int, Any]:
        """Run ``request`` as a fresh run on the kept rank; a payload that cannot be pickled forks instead."""
        rank_env = local_environments(request, None)[0]
        try:
            task = dumps_payload(request.function, request.args, request.kwargs)  # loaded after the rank's freeze
            # run_fresh and the snapshot are importable and plain: pickle's dumps is a third quicker than cloudpickle's
            lifecycle = cloudpickle.dumps(request.lifecycle)  # by value: the notebook may define it
            payload = pickle.dumps((run_fresh, (snapshot_caller(rank_env), task, lifecycle), {}),
                                   protocol=pickle.HIGHEST_PROTOCOL)
        except PayloadPicklingError:
            return LOCAL_LAUNCHER.launch(request)  # a fork reaches the caller's objects without pickling
        with _lock:
            warm = _kept_rank(request, rank_env)
            with SupervisedRun(request, Lifetime("warm")) as run:
                ok = False
                began = time.time()
                try:
                    fresh: FreshResult = warm.ranks.run_payload(payload, run=run, result_ranks=None)[0]
                    warm.rank_files.update(dict.fromkeys(fresh.module_files, began))
                    if fresh.replace:  # what the run left cannot be undone in place: the next launch gets a new rank
                        _close_locked()
                    ok = True
                    return {0: fresh.value}
                finally:
                    warm.runs += 1
                    warm.last_used = time.monotonic()
                    if not ok:
                        _close_locked()  # a failure may leave the rank unusable (a CUDA error sticks to its context)


def _kept_rank(request: LaunchRequest, rank_env: dict[str, str]) -> _WarmRank:
    """The kept rank for ``request``'s settings: reused when still good, else started anew (lock held)."""
    global _warm
    _forget_inherited()
    key = (request.plan.start_method, request.plan.device_kind, request.plan.visible_gpus,
           tuple(sorted(rank_env.items())))
    stale = _warm is not None and (_warm.key != key or _warm.ranks.dead() or _modules_changed(_warm))
    if stale:
        _close_locked()
    if _warm is None:
        if request.plan.start_method == "fork":  # the rank starts with what a launch's worker would
            prepare_to_fork(request.function, request.warm_imports)
        timeout = request.config.timeout  # the caller's timeout bounds the start too, not only the run
        started = LocalPoolRanks.start(dataclasses.replace(request, warm_imports=False),
                                       min(START_TIMEOUT, timeout) if timeout else START_TIMEOUT)
        _warm = _WarmRank(key=key, ranks=started, device_kind=request.plan.device_kind,
                          start_method=request.plan.start_method)
        _warm.finalizer = weakref.finalize(_warm, started.shutdown)
        threading.Thread(target=_watch_idle, args=(_warm,), name="nbaccel-warm-idle", daemon=True).start()
    return _warm


def _watch_idle(warm: _WarmRank) -> None:
    """Close ``warm`` once it has been idle :data:`IDLE_CLOSE_SECONDS` (one thread per kept rank, none per launch)."""
    while not warm.closed.wait(max(0.05, warm.last_used + IDLE_CLOSE_SECONDS - time.monotonic())):
        with _lock:  # held for a whole run: a busy rank is never idle here
            if _warm is not warm:
                return
            if time.monotonic() - warm.last_used >= IDLE_CLOSE_SECONDS:
                _close_locked()
                return


def _close_locked() -> None:
    global _warm
    _forget_inherited()
    warm, _warm = _warm, None
    if warm is not None:
        warm.close()


def close_warm_rank() -> bool:
    """Close the kept rank, if there is one (``%accel_workers stop``); whether there was one.

    A background run on it is cancelled first (it holds the rank's lock for as long as it runs).
    """
    cancelled = cancel_holders([WARM_RANK])  # its end closed the rank already (an interrupted rank is closed)
    with _lock:
        had = _warm is not None or bool(cancelled)
        _close_locked()
        return had


def warm_rank_info() -> WarmRankInfo | None:
    """The kept rank, or ``None``."""
    warm = _warm
    if warm is None or warm.owner != os.getpid() or warm.ranks.dead():
        return None
    member = warm.ranks.members[0]
    return WarmRankInfo(pid=member.handle.pid, device=member.device, start_method=warm.start_method,
                        idle_seconds=time.monotonic() - warm.last_used, runs=warm.runs)


def release_warm_devices(request: LaunchRequest) -> None:
    """Close the kept rank when ``request`` (another launch, or a pool) will use the GPUs it holds."""
    if request.launcher == "warm" or _warm is None:
        return
    if _warm.device_kind == "cuda" and request.plan.device_kind == "cuda":
        with _lock:
            if _warm is not None and _warm.device_kind == "cuda":
                _close_locked()


def _modules_changed(warm: _WarmRank) -> bool:
    """Whether a module of the user's, imported in the caller or by a run in the rank, changed on disk since."""
    return (changed_since((path, warm.started_at) for path in user_module_files())
            or changed_since(warm.rank_files.items()))


LAUNCHER = WarmLauncher()
BACKEND = Backend(LAUNCHER, before_launch=release_warm_devices)  # every launch asks, once this is loaded
