"""A warm rank's process state: taken before its first run, put back after each run, or the rank replaced.

:mod:`nbaccel.launch.pool.fresh_task` gives each run on a warm rank what a newly forked worker
would inherit; this module covers what lives in the *process*: descendants (killed and reaped),
threads (they get :data:`THREAD_GRACE` seconds to end), signal handlers, mask and timers, umask,
resource limits, user and groups, the recursion limit, torch's thread counts, atexit callbacks,
warnings filters and logging (the README's "A repeated one-process launch" says to what each
goes back). What cannot be put back (a thread still running, a lowered hard limit, a changed
user, torch's inter-op thread count) gets the rank replaced: :func:`end_run` returns why (``None``:
it need not), and the caller closes it before the launch returns. The objects that exist before
the first run are frozen (``gc.freeze``) once, so each run's collection walks only what runs made.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import resource
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar, cast

from nbaccel.launch.worker.descendants import end_descendants

__all__ = ["FREEZE_AFTER_SECONDS", "THREAD_GRACE", "ProcessBaseline", "RunStart", "begin_run", "collect_garbage",
           "end_run", "freeze_long_lived", "process_baseline"]

THREAD_GRACE = 0.5
"""Seconds a thread the run started has, after the run, to end by itself before the rank is replaced."""
FREEZE_AFTER_SECONDS = 0.001
"""A run that imported modules and whose collection took more CPU time than this (a few thousand objects) has
what survives frozen at the start of the next run, before that run's function and arguments exist."""

_SIGNALS = [int(s) for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)]
_signal = sys.modules["_signal"]  # signal's own import, no stubs: raw handlers (signal.getsignal's enums: 0.7 us)
_TIMERS = [signal.ITIMER_REAL, signal.ITIMER_VIRTUAL, signal.ITIMER_PROF]
_RLIMITS = {name: getattr(resource, name) for name in dir(resource) if name.startswith("RLIMIT_")}


@dataclass
class ProcessBaseline:
    """The rank's process state before its first run (see the module docstring)."""

    recursion_limit: int
    handlers: list[Any]
    mask: set[int]
    umask: int
    rlimits: dict[str, tuple[int, int]]
    atexit_count: int
    ids: tuple[tuple[int, ...], tuple[int, ...], list[int]]
    torch_threads: tuple[int, int] | None = None
    loggers: dict[str, tuple[int, list[Any], bool, bool]] = field(default_factory=dict)
    logging_disable: int = 0


@dataclass
class RunStart:
    """What a run started from: its threads, warnings filters and imported modules."""

    threads: set[int]
    filters: list[Any]
    showwarning: Any
    module_count: int = field(default_factory=lambda: len(sys.modules))


_baseline: ProcessBaseline | None = None
_freeze_next = False
_modules_when_frozen = 0  # len(sys.modules) at the last freeze: more means runs imported modules since


def process_baseline() -> ProcessBaseline:
    """This rank's state before its first run, taken at the first call (which also freezes what exists then)."""
    global _baseline
    if _baseline is None:
        umask = os.umask(0o022)
        os.umask(umask)
        _baseline = ProcessBaseline(
            recursion_limit=sys.getrecursionlimit(), handlers=[_signal.getsignal(s) for s in _SIGNALS],
            mask=set(signal.pthread_sigmask(signal.SIG_BLOCK, [])), umask=umask,
            rlimits={name: resource.getrlimit(limit) for name, limit in _RLIMITS.items()},
            atexit_count=atexit._ncallbacks() if hasattr(atexit, "_ncallbacks") else 0, ids=_ids())
        _restore_logging(_baseline)  # takes every logger's state
        atexit.register = _recording_register  # so that what a run registers can be unregistered after it
        gc.freeze()  # what the rank held before any run is never a run's garbage: collections skip it
        global _modules_when_frozen
        _modules_when_frozen = len(sys.modules)
    torch = sys.modules.get("torch")
    if _baseline.torch_threads is None and torch is not None:
        _baseline.torch_threads = (torch.get_num_threads(), torch.get_num_interop_threads())
    return _baseline


def collect_garbage() -> None:
    """Collect what the run left (cycles included); note when modules runs imported make collections slow."""
    global _freeze_next
    began = time.thread_time()  # CPU time: a busy machine's preemption must not read as many objects
    gc.collect()
    slow = time.thread_time() - began > FREEZE_AFTER_SECONDS
    _freeze_next = _freeze_next or (slow and len(sys.modules) != _modules_when_frozen)


def freeze_long_lived() -> None:
    """At a run's start, before its function and arguments are loaded: freeze the survivors, when they are many.

    What survives runs that imported modules is mostly what those imports made (modules, classes,
    functions: never garbage), which every later collection would walk again (75-130 ms a run here
    after a run imported transformers; 1-2 ms after one that built an ``Accelerator`` and a model).
    Frozen, it is skipped. Anything such a run left reachable from a module (a cache, a global) is
    frozen with it: a reference cycle among those objects is then collected only when the rank is
    replaced. Runs that import nothing never freeze what they leave.
    """
    global _freeze_next, _modules_when_frozen
    if _freeze_next:
        _freeze_next = False
        gc.collect()
        gc.freeze()
        _modules_when_frozen = len(sys.modules)


def begin_run() -> RunStart:
    """What the run about to start begins from (taken after the caller's state was put in place)."""
    return RunStart(threads={t.ident for t in threading.enumerate() if t.ident is not None},
                    filters=list(warnings.filters), showwarning=warnings.showwarning)


def end_run(baseline: ProcessBaseline, start: RunStart) -> str | None:
    """Put the process back as it was (see the module docstring); why the rank must be replaced, or ``None``."""
    sys.setrecursionlimit(baseline.recursion_limit)  # first: what follows recurses, whatever limit the run left
    reasons = [reason for step in (_end_descendants, _end_threads) if (reason := step(start))]
    for step in (_check_ids, _restore_signals, _restore_limits, _restore_torch_threads, _drop_atexit):
        try:
            reason = step(baseline)
        except Exception as exc:  # noqa: BLE001 - a state that cannot be put back means a new rank, not a failed run
            reason = f"{step.__name__.strip('_').replace('_', ' ')} failed: {exc}"
        if reason:
            reasons.append(reason)
    _restore_warnings(start)
    _restore_logging(baseline)
    return "; ".join(reasons) or None


def _end_descendants(start: RunStart) -> str | None:
    end_descendants()  # Popen children, forked children, daemons orphaned to this subreaper
    return None


def _end_threads(start: RunStart) -> str | None:
    deadline = time.monotonic() + THREAD_GRACE
    left = []
    for thread in threading.enumerate():
        if thread.ident in start.threads or thread is threading.current_thread() or _native(thread):
            continue
        stop = _HOUSEKEEPERS.get(f"{type(thread).__module__}.{type(thread).__qualname__}")
        if stop is not None:
            stop(thread)
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            left.append(thread.name)
    return f"threads the run started were still running after it returned: {', '.join(left)}" if left else None


# Threads a library starts for itself on first use and keeps for the process's life, with the
# library's own way of ending them (the library starts a new one when it next needs it). Replacing
# the rank after every run that showed a progress bar would cost each such launch a new rank.
_HOUSEKEEPERS: dict[str, Callable[[threading.Thread], Any]] = {
    "tqdm._monitor.TMonitor": lambda monitor: monitor.exit(),  # type: ignore[attr-defined]  # tqdm's TMonitor, typed as a Thread here
}


def _native(thread: threading.Thread) -> bool:
    """A thread Python did not start (torch's autograd threads calling a hook): not the run's to end."""
    return isinstance(thread, getattr(threading, "_DummyThread", ()))


def _ids() -> tuple[tuple[int, ...], tuple[int, ...], list[int]]:
    return os.getresuid(), os.getresgid(), sorted(os.getgroups())


def _check_ids(baseline: ProcessBaseline) -> str | None:
    if _ids() != baseline.ids:  # a process that gave up its user cannot take it back
        return f"the run changed the rank's user or groups (now uid {os.getuid()}, gid {os.getgid()})"
    return None


def _restore_signals(baseline: ProcessBaseline) -> str | None:
    for number, handler in zip(_SIGNALS, baseline.handlers):
        if _signal.getsignal(number) is not handler:
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)
    if set(signal.pthread_sigmask(signal.SIG_BLOCK, [])) != baseline.mask:
        signal.pthread_sigmask(signal.SIG_SETMASK, baseline.mask)
    for timer in _TIMERS:
        if signal.getitimer(timer) != (0.0, 0.0):
            signal.setitimer(timer, 0.0)
    return None


def _restore_limits(baseline: ProcessBaseline) -> str | None:
    os.umask(baseline.umask)
    stuck = []
    for name, limit in _RLIMITS.items():
        if resource.getrlimit(limit) != baseline.rlimits[name]:
            try:
                resource.setrlimit(limit, baseline.rlimits[name])
            except (ValueError, OSError):  # a hard limit lowered without the privilege to raise it again
                stuck.append(name)
    return f"the run lowered resource limits that cannot be raised again: {', '.join(stuck)}" if stuck else None


def _restore_torch_threads(baseline: ProcessBaseline) -> str | None:
    torch = sys.modules.get("torch")
    if torch is None or baseline.torch_threads is None:
        return None
    intra, inter = baseline.torch_threads
    if torch.get_num_threads() != intra:
        torch.set_num_threads(intra)
    if torch.get_num_interop_threads() != inter:
        return f"the run set torch's inter-op threads to {torch.get_num_interop_threads()} (once per process)"
    return None


_P = ParamSpec("_P")
_T = TypeVar("_T")
_registered: list[Any] = []  # what runs registered with atexit, since the last run ended
_register = atexit.register


def _recording_register(function: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> Callable[_P, _T]:
    _registered.append(function)
    return _register(function, *args, **kwargs)


def _drop_atexit(baseline: ProcessBaseline) -> str | None:
    for function in _registered:
        atexit.unregister(function)  # leaves a hole: the count atexit keeps never goes down
    baseline.atexit_count += len(_registered)
    _registered.clear()
    if hasattr(atexit, "_ncallbacks") and atexit._ncallbacks() != baseline.atexit_count:
        # registered past the recorder (a reference to atexit.register kept from before): the rank leaves by
        # os._exit, so none of them would ever run; they would only hold objects
        atexit._clear()
        baseline.atexit_count = 0
    return None


def _restore_warnings(start: RunStart) -> None:
    if warnings.filters != start.filters:
        cast(list[Any], warnings.filters)[:] = start.filters  # a list at run time (typeshed: a Sequence)
        cast(Any, warnings)._filters_mutated()  # (private) the per-module "already shown" registries follow them
    warnings.showwarning = start.showwarning


def _restore_logging(baseline: ProcessBaseline) -> None:
    """Loggers back to their state before the first run; one made since keeps the state it had when first seen.

    One walk per run (a few hundred loggers with torch imported: tens of microseconds). A logger a
    run made is a library's, made when the run imported it: that state is what the next run gets.
    """
    manager = logging.root.manager
    changed = manager.disable != baseline.logging_disable
    manager.disable = baseline.logging_disable
    states = baseline.loggers
    for name, logger in [("", logging.root), *manager.loggerDict.items()]:
        if not isinstance(logger, logging.Logger):  # a PlaceHolder: a dotted name's parent made by no one
            continue
        state = states.get(name)
        if state is None:
            states[name] = (logger.level, logger.handlers[:], logger.propagate, logger.disabled)
        elif (logger.level, logger.handlers, logger.propagate, logger.disabled) != state:
            logger.level, handlers, logger.propagate, logger.disabled = state
            logger.handlers[:] = handlers
            changed = True
    if changed:
        cast(Any, manager)._clear_cache()  # loggers cache their effective level (private, not in typeshed)
