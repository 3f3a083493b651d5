"""Accelerator methods for DDP edge cases: training on uneven inputs, and forcing a sync inside ``no_sync``.

``join_uneven_inputs`` wraps ``torch.distributed.algorithms.Join``, so processes that run out of
batches early shadow the collectives of the others instead of hanging them;
``trigger_sync_in_backward`` makes one backward all-reduce while the model is in ``no_sync``.
Both as in Accelerate; mixed into :class:`~nbaccel.Accelerator`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from nbaccel.training.data_loader import DataLoaderDispatcher

__all__ = ["UnevenInputs"]


class UnevenInputs:
    """``join_uneven_inputs`` and ``trigger_sync_in_backward`` for an object with ``num_processes``,
    ``even_batches`` and ``_dataloaders`` (the Accelerator)."""

    _dataloaders: Any

    if TYPE_CHECKING:  # read-only properties of the Accelerator; declared here for the type checker only
        @property
        def num_processes(self) -> int: ...
        @property
        def even_batches(self) -> bool: ...

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: Sequence[Any], even_batches: bool | None = None) -> Iterator[None]:
        """Let processes with fewer batches finish early without hanging the others (``torch``'s ``Join``).

        Args:
            joinables: the DDP models (and ``ZeroRedundancyOptimizer`` s) that take part.
            even_batches: for the block, override the prepared map-style loaders' ``even_batches``
                (``False`` gives each process only its own samples; ``Join`` covers the difference).
                ``None`` keeps the Accelerator's setting; ``Join`` is enabled only when it is off.

        Example:
            >>> with accelerator.join_uneven_inputs([ddp_model], even_batches=False):  # doctest: +SKIP
            ...     for x, y in loader: accelerator.backward(loss(model(x), y))
        """
        if self.num_processes <= 1:  # Join needs Joinable models; nothing to join in one process
            yield
            return
        from torch.distributed.algorithms import Join, Joinable

        strangers = [type(j).__name__ for j in joinables if not isinstance(j, Joinable)]
        if strangers:  # FSDP, DeepSpeed, an unwrapped model: Join cannot take them (Accelerate too
            # warns and runs the block as it is, there on anything but multi-GPU)
            warnings.warn("Joining uneven inputs is only supported for multi-GPU or multi-CPU DDP models (torch "
                          f"Joinables); got {strangers}, so join_uneven_inputs has no effect: the block runs as it is, "
                          "with even_batches "
                          "unchanged. Fix: prepare the model for DDP, or keep even_batches=True.",
                          stacklevel=3)
            yield
            return

        overridden: list[tuple[Any, bool]] = []
        if even_batches is not None:
            iterable_seen = False
            for loader in self._dataloaders:
                if isinstance(loader, DataLoaderDispatcher) or not hasattr(loader.batch_sampler, "even_batches"):
                    iterable_seen = True
                    continue
                overridden.append((loader.batch_sampler, loader.batch_sampler.even_batches))
                loader.batch_sampler.even_batches = even_batches
            if iterable_seen:
                warnings.warn("Overriding even_batches is only supported for map-style datasets, yet some "
                              "dataloaders given were iterable", stacklevel=3)
        else:
            even_batches = self.even_batches
        try:
            with Join(list(joinables), enable=not even_batches, throw_on_early_termination=False):
                yield
        finally:
            for sampler, value in overridden:
                sampler.even_batches = value

    @contextlib.contextmanager
    def trigger_sync_in_backward(self, model: torch.nn.Module) -> Iterator[None]:
        """Within ``no_sync``, make the next backward of ``model`` all-reduce its gradients after all (DDP).

        Does nothing for a model that is not DDP-wrapped (one process, or FSDP).

        Example:
            >>> with accelerator.no_sync(model):  # doctest: +SKIP
            ...     with accelerator.trigger_sync_in_backward(model):
            ...         accelerator.backward(loss)   # gradients are averaged across processes
        """
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            yield
            return
        backward_sync, forward_sync = model.require_backward_grad_sync, model.require_forward_param_sync
        model.require_backward_grad_sync = True
        model.require_forward_param_sync = True
        model.reducer.prepare_for_backward([])  # re-arm the reducer no_sync left idle
        try:
            yield
        finally:
            model.require_backward_grad_sync = backward_sync
            model.require_forward_param_sync = forward_sync
