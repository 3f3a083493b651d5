"""What a process can ask of its process state alone: printing, barriers, splits, main-process decorators.

:class:`StateHelpers` needs only ``self.state`` (a :class:`~nbaccel.process_state.ProcessState`), so
``PartialState`` (root) and the ``Accelerator`` (:mod:`nbaccel.training`, whose
:class:`~nbaccel.training.process_helpers.ProcessHelpers` adds collectives that need its gradient
state) share one copy, and the root package never imports :mod:`nbaccel.training`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar, cast

import torch

from nbaccel.errors import ConfigError
from nbaccel.process_state import ProcessState

__all__ = ["StateHelpers"]

F = TypeVar("F", bound=Callable[..., Any])


class StateHelpers:
    """Mixin: what every process can ask of its process state (needs ``state``)."""

    state: ProcessState

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the local main process only.

        Example:
            >>> accelerator.print("epoch", 1)   # doctest: +SKIP
        """
        if self.state.is_local_main_process:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        """Block until every process gets here (``xm.rendezvous`` on XLA)."""
        self.state.wait_for_everyone()

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Run the block on the main process first, then on the others (e.g. to download once).

        Example:
            >>> with accelerator.main_process_first():   # doctest: +SKIP
            ...     dataset = load_or_build()
        """
        with self._first(self.state.is_main_process):
            yield

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """Like :meth:`main_process_first`, per machine."""
        with self._first(self.state.is_local_main_process):
            yield

    @contextlib.contextmanager
    def _first(self, is_first: bool) -> Iterator[None]:
        if not is_first:
            self.wait_for_everyone()
        yield
        if is_first:
            self.wait_for_everyone()

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """Give each process its contiguous share of a list, tuple, dict of lists, tensor, or ``datasets.Dataset``.

        Args:
            inputs: what to split (along the first dimension / items).
            apply_padding: repeat the last item so every share has the same length.

        Raises:
            ConfigError: dict values of different lengths.

        Example:
            >>> with accelerator.split_between_processes(["a", "b", "c"]) as mine:   # doctest: +SKIP
            ...     print(mine)   # ['a', 'b'] on rank 0, ['c'] on rank 1
        """
        yield _split(inputs, self.state.num_processes, self.state.process_index, apply_padding)

    # ------------------------------------------------------------------ decorators
    def on_main_process(self, function: F) -> F:
        """Decorate ``function`` to run only on the main process (elsewhere it returns ``None``).

        Example:
            >>> @accelerator.on_main_process   # doctest: +SKIP
            ... def log(msg): print(msg)
        """
        return self._only_if(function, lambda: self.state.is_main_process)

    def on_local_main_process(self, function: F) -> F:
        """Decorate ``function`` to run only on each machine's local main process."""
        return self._only_if(function, lambda: self.state.is_local_main_process)

    def on_last_process(self, function: F) -> F:
        """Decorate ``function`` to run only on the last process."""
        return self._only_if(function, lambda: self.state.is_last_process)

    def on_process(self, function: F | None = None, process_index: int | None = None) -> Any:
        """Decorate ``function`` to run only on the process with global rank ``process_index``.

        Raises:
            ConfigError: ``process_index`` is missing.
        """
        if process_index is None:
            raise ConfigError("on_process needs `process_index`; use @accelerator.on_process(process_index=0)",
                              key="process_index", value=None, valid="an int rank")
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        return self._only_if(function, lambda: self.state.process_index == process_index)

    def on_local_process(self, function: F | None = None, local_process_index: int | None = None) -> Any:
        """Decorate ``function`` to run only on the process with local rank ``local_process_index``.

        Raises:
            ConfigError: ``local_process_index`` is missing.
        """
        if local_process_index is None:
            raise ConfigError("on_local_process needs `local_process_index`; use "
                              "@accelerator.on_local_process(local_process_index=0)", key="local_process_index",
                              value=None, valid="an int local rank")
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        return self._only_if(function, lambda: self.state.local_process_index == local_process_index)

    @staticmethod
    def _only_if(function: F, condition: Callable[[], bool]) -> F:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs) if condition() else None

        return wrapper  # type: ignore[return-value]  # functools.wraps keeps the signature


def _is_hf_dataset(inputs: Any) -> bool:
    """A Hugging Face ``datasets.Dataset`` (told by its type's module: importing ``datasets`` is slow)."""
    return type(inputs).__module__.startswith("datasets.") and hasattr(inputs, "select")


def _split(inputs: Any, n: int, rank: int, apply_padding: bool) -> Any:
    if n == 1:
        return inputs
    if _is_hf_dataset(inputs):  # rows as a Dataset (ds[a:b] would be a dict of columns), as Accelerate does
        per, extra = divmod(len(inputs), n)
        start = rank * per + min(rank, extra)
        rows = list(range(start, start + per + (1 if rank < extra else 0)))
        if apply_padding:
            rows += [len(inputs) - 1] * (per + (1 if extra else 0) - len(rows))
        return inputs.select(rows)
    if isinstance(inputs, Mapping):
        lengths = {k: len(v) for k, v in inputs.items()}
        if len(set(lengths.values())) > 1:
            raise ConfigError(f"split_between_processes needs dict values of one length (got lengths {lengths})",
                              key="inputs", value=lengths, valid="equal lengths")
        # Mapping's own __init__ takes nothing, but the mappings split here (dict, BatchEncoding...) take a dict
        return cast(Callable[[dict[Any, Any]], Any], type(inputs))({k: _split(v, n, rank, apply_padding)
                                                                    for k, v in inputs.items()})
    length = len(inputs)
    per, extra = divmod(length, n)
    start = rank * per + min(rank, extra)
    end = start + per + (1 if rank < extra else 0)
    part = inputs[start:end]
    if apply_padding:
        target = per + (1 if extra else 0)
        missing = target - (end - start)
        if missing > 0:
            if torch.is_tensor(part):
                filler = inputs[-1:].expand(missing, *inputs.shape[1:])
                part = torch.cat([part, filler], dim=0)
            else:
                part = part + type(part)([inputs[-1]] * missing)
    return part
