"""The Accelerator's per-process helpers: collectives, printing, barriers, and main-process decorators.

Kept apart from :mod:`nbaccel.training.accelerator` so that module stays about training. Everything
here needs only ``self.state`` (a :class:`~nbaccel.process_state.ProcessState`) and, for
``gather_for_metrics``, ``self.gradient_state``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import torch

from nbaccel import ops
from nbaccel.errors import ConfigError
from nbaccel.nested_data import recursively_apply
from nbaccel.process_state import ProcessState
from nbaccel.training.gradient_state import GradientState

__all__ = ["ProcessHelpers"]

F = TypeVar("F", bound=Callable[..., Any])


class ProcessHelpers:
    """Mixin: what every process can ask of the job (needs ``state`` and ``gradient_state``)."""

    state: ProcessState
    gradient_state: GradientState

    # ------------------------------------------------------------------ collectives
    def gather(self, tensor: Any) -> Any:
        """Gather tensors (any nesting) from all processes, concatenated on the first dimension.

        Example:
            >>> accelerator.gather(torch.tensor([accelerator.process_index]))   # doctest: +SKIP
            tensor([0, 1])
        """
        return ops.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather predictions or labels for a metric, dropping the samples that padded the last batch.

        Args:
            input_data: tensors (any nesting) or, with ``use_gather_object``, any picklable objects.
            use_gather_object: gather arbitrary objects (chosen automatically for non-tensors).

        Example:
            >>> for x, y in eval_loader:                      # doctest: +SKIP
            ...     preds, refs = accelerator.gather_for_metrics((model(x).argmax(-1), y))
        """
        try:
            recursively_apply(lambda t: t, input_data, error_on_other_type=True)
            all_tensors = True
        except TypeError:
            all_tensors = False
        use_gather_object = use_gather_object or not all_tensors
        data = ops.gather_object(input_data) if use_gather_object else ops.gather(input_data)
        state = self.gradient_state
        if not (state.end_of_dataloader and state.remainder > 0):
            return data
        keep = state.remainder
        if use_gather_object:
            return data[:keep]
        return recursively_apply(lambda t: t[:keep], data)

    def gather_object(self, obj: Any) -> Any:
        """Gather picklable objects from all processes: one flat list of every rank's items.

        In a single process the object comes back unchanged, as in Accelerate.
        """
        return ops.gather_object(obj)

    def reduce(self, tensor: Any, reduction: ops.Reduction = "sum", scale: float = 1.0) -> Any:
        """Reduce tensors across processes: ``"sum"``, ``"mean"``, ``"max"``, or ``"none"`` (summed, like Accelerate).

        ``scale`` multiplies the result on XLA only, as in Accelerate.

        Example:
            >>> accelerator.reduce(torch.tensor(1.0))   # doctest: +SKIP
            tensor(2.)
        """
        return ops.reduce(tensor, reduction, scale)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """Pad tensors along ``dim`` to the largest size on any process, so they can be gathered."""
        return ops.pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)

    def broadcast(self, tensor: Any, from_process: int = 0) -> Any:
        """Send ``from_process``'s tensors to all processes."""
        return ops.broadcast(tensor, from_process)

    # ------------------------------------------------------------------ printing and barriers
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

    # ------------------------------------------------------------------ triggers
    def set_trigger(self) -> None:
        """Raise a flag on this process that :meth:`check_trigger` sees on every process (early stop)."""
        self._trigger = True

    def check_trigger(self) -> bool:
        """Whether any process called :meth:`set_trigger` since the last check (resets the flag).

        Example:
            >>> if loss.isnan(): accelerator.set_trigger()        # doctest: +SKIP
            >>> if accelerator.check_trigger(): break              # doctest: +SKIP
        """
        flag = torch.tensor([1.0 if getattr(self, "_trigger", False) else 0.0], device=self.state.device)
        if ops.reduce(flag, "sum").item() > 0:
            self._trigger = False
            return True
        return False


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
        return type(inputs)({k: _split(v, n, rank, apply_padding) for k, v in inputs.items()})
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
