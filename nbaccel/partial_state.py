"""Accelerate's names for the process state: `PartialState` and `AcceleratorState` over `ProcessState`.

Both are thin subclasses of :class:`~nbaccel.process_state.ProcessState`, so they share its one state
per process (rank, world size, device, backend) and its attribute names, which are Accelerate's:
``num_processes``, ``process_index``, ``local_process_index``, ``device``, ``distributed_type``,
``backend``, ``is_main_process``, ``is_local_main_process``, ``is_last_process``,
``use_distributed``, ``mixed_precision``. They add the per-process helpers Accelerate's
``PartialState`` has (``print``, ``main_process_first``, ``split_between_processes``, the
``on_*`` decorators), taken from :class:`~nbaccel.state_helpers.StateHelpers` (the ``Accelerator``'s too).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch

from nbaccel.process_state import ProcessState, shared_state
from nbaccel.state_helpers import StateHelpers

__all__ = ["AcceleratorState", "PartialState"]

F = TypeVar("F", bound=Callable[..., Any])


class _Helpers(StateHelpers):
    """The helpers that need only a process state, bound to one."""

    def __init__(self, state: ProcessState) -> None:
        self.state = state


class PartialState(ProcessState):
    """Accelerate's ``PartialState``: this process's place in the job, without training settings.

    The same shared state as :class:`~nbaccel.process_state.ProcessState` (the first one made in a
    process decides ``cpu``).

    Args:
        cpu: run on CPU even where accelerators exist.
        backend: the ``torch.distributed`` backend; default ``nccl`` on CUDA, ``gloo`` on CPU.
        timeout: collective timeout for the process group.

    Example:
        >>> state = PartialState()
        >>> state.process_index, state.num_processes, state.is_main_process
        (0, 1, True)
    """

    @property
    def initialized(self) -> bool:
        """``True``: a state exists as soon as one is made (Accelerate's flag)."""
        return bool(self.__dict__.get("_initialized"))

    @property
    def default_device(self) -> torch.device:
        """The device this process uses (nbaccel picks it once, when the state is made)."""
        return self.device

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the local main process only."""
        _Helpers(self).print(*args, **kwargs)

    def main_process_first(self) -> contextlib.AbstractContextManager[None]:
        """Run the block on the main process first, then on the others."""
        return _Helpers(self).main_process_first()

    def local_main_process_first(self) -> contextlib.AbstractContextManager[None]:
        """Run the block on each machine's local main process first, then on the others."""
        return _Helpers(self).local_main_process_first()

    def split_between_processes(self, inputs: Any, apply_padding: bool = False
                                ) -> contextlib.AbstractContextManager[Any]:
        """Give each process its contiguous share of a list, tuple, dict of lists, or tensor.

        Example:
            >>> with PartialState().split_between_processes([1, 2, 3]) as mine:
            ...     mine   # one process: everything
            [1, 2, 3]
        """
        return _Helpers(self).split_between_processes(inputs, apply_padding)

    def on_main_process(self, function: F) -> F:
        """Decorate ``function`` to run only on the main process (elsewhere it returns ``None``)."""
        return _Helpers(self).on_main_process(function)

    def on_local_main_process(self, function: F) -> F:
        """Decorate ``function`` to run only on each machine's local main process."""
        return _Helpers(self).on_local_main_process(function)

    def on_last_process(self, function: F) -> F:
        """Decorate ``function`` to run only on the last process."""
        return _Helpers(self).on_last_process(function)

    def on_process(self, function: F | None = None, process_index: int | None = None) -> Any:
        """Decorate ``function`` to run only on the process with global rank ``process_index``."""
        return _Helpers(self).on_process(function, process_index=process_index)

    def on_local_process(self, function: F | None = None, local_process_index: int | None = None) -> Any:
        """Decorate ``function`` to run only on the process with local rank ``local_process_index``."""
        return _Helpers(self).on_local_process(function, local_process_index=local_process_index)


class AcceleratorState(PartialState):
    """Accelerate's ``AcceleratorState``: the shared state an :class:`~nbaccel.Accelerator` runs in.

    ``Accelerator().state`` is one. The training settings themselves (mixed precision chosen by
    the ``Accelerator``, plugins) live on the ``Accelerator``; ``mixed_precision`` here is the
    launch's setting.

    Example:
        >>> state = AcceleratorState()
        >>> state.distributed_type, state.mixed_precision
        (<DistributedType.NO: 'NO'>, 'no')
    """

    def __init__(self, cpu: bool = False, backend: str | None = None, timeout: timedelta | None = None,
                 cpu_collectives: bool = False) -> None:
        shared_state().pop(_FORGOTTEN, None)  # a new one sets the state up again
        super().__init__(cpu, backend, timeout, cpu_collectives)

    def __getattribute__(self, name: str) -> Any:
        if not name.startswith("_"):
            shared = object.__getattribute__(self, "__dict__")
            if _FORGOTTEN in shared:
                if name in _ASKS_PARTIAL_STATE:  # Accelerate's AcceleratorState answers these from PartialState()
                    return getattr(PartialState(), name)
                if name in shared or isinstance(getattr(type(self), name, None), property):
                    raise AttributeError(_forgotten(name))
        return super().__getattribute__(name)

    def __getattr__(self, name: str) -> Any:  # only reached when the shared state was cleared
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(_forgotten(name))

    @classmethod
    def _reset_state(cls, reset_partial_state: bool = False) -> None:
        """Accelerate's ``AcceleratorState._reset_state``: forget the training state (and the process state).

        Until an ``Accelerator`` or ``AcceleratorState`` is made again, every ``AcceleratorState``
        (a live ``Accelerator``'s too) raises Accelerate's ``AttributeError`` on its settings, so
        its next ``prepare`` fails as in Accelerate; the process flags Accelerate's state reads from
        ``PartialState()`` (``is_main_process``, ``is_local_main_process``, ``is_last_process``,
        ``use_distributed``, ``initialized``) keep working.
        ``PartialState`` keeps working unless ``reset_partial_state``, which forgets the process
        state as well.
        """
        if reset_partial_state:
            super()._reset_state()
            return
        shared = shared_state()
        if shared.get("_initialized"):
            shared[_FORGOTTEN] = True


_FORGOTTEN = "_accelerator_state_forgotten"
_ASKS_PARTIAL_STATE = frozenset({"is_main_process", "is_local_main_process", "is_last_process", "use_distributed",
                                 "initialized"})


def _forgotten(name: str) -> str:
    return (f"`AcceleratorState` object has no attribute `{name}`. This happens if "
            "`AcceleratorState._reset_state()` was called and an `Accelerator` or `PartialState` was not "
            "reinitialized.")
