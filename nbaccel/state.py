"""Accelerate's ``accelerate.state`` at nbaccel's path: the process state, its Accelerate names, the gradient state.

Users write ``from accelerate.state import AcceleratorState, PartialState, GradientState``; the
same line works with ``nbaccel.state``. This module only gathers names (and defines the one
Accelerate helper no other module needs, :class:`ThreadLocalSharedDict`). Inside nbaccel, import
from where each name lives: :mod:`nbaccel.process_state` (``ProcessState`` and the shared state
of this process), :mod:`nbaccel.partial_state` (``PartialState``, ``AcceleratorState``),
:mod:`nbaccel.training.gradient_state` (``GradientState``). Nothing inside nbaccel imports this
module, so importing everything here plainly makes no cycle.

Example:
    >>> from nbaccel.state import AcceleratorState, PartialState, ProcessState
    >>> issubclass(AcceleratorState, PartialState) and issubclass(PartialState, ProcessState)
    True
"""

from __future__ import annotations

import threading

from nbaccel.device_backend import (
    get_distributed_backend,
    get_torch_accelerator_backend,
)
from nbaccel.introspection import do_nothing
from nbaccel.partial_state import AcceleratorState, PartialState
from nbaccel.process_state import (
    CUDA_WITH_CPU_BACKEND,
    ProcessState,
    is_initialized,
    reset_process_state,
    shared_state,
    wait_for_everyone,
)
from nbaccel.training.gradient_state import GradientState

__all__ = ["AcceleratorState", "CUDA_WITH_CPU_BACKEND", "GradientState", "PartialState", "ProcessState",
           "ThreadLocalSharedDict", "do_nothing", "get_distributed_backend", "get_torch_accelerator_backend",
           "is_initialized", "reset_process_state", "shared_state", "wait_for_everyone"]


class ThreadLocalSharedDict(threading.local):
    """A class attribute whose dict is each thread's own (Accelerate's shared state under XLA threads).

    Used as a descriptor: ``_shared_state = ThreadLocalSharedDict()`` gives every thread its own
    ``_shared_state`` dict, as ``torch_xla`` replicas run as threads of one process.

    Example:
        >>> class Shared:
        ...     state = ThreadLocalSharedDict()
        >>> Shared.state["rank"] = 0
        >>> t = threading.Thread(target=lambda: Shared.state.setdefault("rank", 1)); t.start(); t.join()
        >>> Shared.state
        {'rank': 0}
    """

    def __init__(self, thread_local: bool = False) -> None:
        self._storage: dict = {}

    def __get__(self, obj: object, objtype: type | None = None) -> dict:
        return self._storage

    def __set__(self, obj: object, value: dict) -> None:
        self._storage = value
