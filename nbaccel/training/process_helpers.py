"""The Accelerator's per-process helpers: collectives, printing, barriers, and main-process decorators.

Kept apart from :mod:`nbaccel.training.accelerator` so that module stays about training. The
helpers that need only ``self.state`` (printing, barriers, splits, ``on_*`` decorators) come from
:class:`~nbaccel.state_helpers.StateHelpers`, which ``PartialState`` shares; the collectives here
add ``gather_for_metrics``, which needs ``self.gradient_state``.
"""

from __future__ import annotations

from typing import Any

import torch

from nbaccel import ops
from nbaccel.nested_data import recursively_apply
from nbaccel.state_helpers import StateHelpers
from nbaccel.training.gradient_state import GradientState

__all__ = ["ProcessHelpers"]


class ProcessHelpers(StateHelpers):
    """Mixin: what every process can ask of the job (needs ``state`` and ``gradient_state``)."""

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
