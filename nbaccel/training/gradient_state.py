"""`GradientState`: whether this step synchronizes gradients, and where the active dataloader is.

One instance belongs to one :class:`~nbaccel.Accelerator` and is shared by the dataloaders,
optimizers and schedulers it prepared: they read ``sync_gradients`` (skip the optimizer step
while accumulating) and ``end_of_dataloader`` / ``remainder`` (``gather_for_metrics`` drops the
samples that padded the last batch). It lives on the instance, not in a process-wide singleton,
so nothing survives into launched workers.
"""

from __future__ import annotations

import weakref
from typing import Any

from nbaccel.training.plugins import GradientAccumulationPlugin

__all__ = ["GradientState"]


class GradientState:
    """Accumulation and end-of-data flags shared by one Accelerator's prepared objects.

    Example:
        >>> state = GradientState(GradientAccumulationPlugin(num_steps=2))
        >>> state.num_steps, state.sync_gradients
        (2, True)
    """

    def __init__(self, gradient_accumulation_plugin: GradientAccumulationPlugin | None = None) -> None:
        self.plugin = gradient_accumulation_plugin or GradientAccumulationPlugin()
        self.sync_gradients = True
        # weak, as Accelerate's: a loader the code dropped mid-pass is not kept alive by this state
        self._references: list[weakref.ref | None] = [None]
        self.is_xla_gradients_synced = False

    @property
    def dataloader_references(self) -> list[Any]:
        """The loaders being iterated, innermost last (``None`` first; a freed loader reads ``None``)."""
        return [None if ref is None else ref() for ref in self._references]

    @property
    def active_dataloader(self) -> Any:
        """The loader being iterated (the innermost), or ``None``."""
        return self.dataloader_references[-1]

    @property
    def num_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self.plugin.num_steps

    @property
    def adjust_scheduler(self) -> bool:
        return self.plugin.adjust_scheduler

    @property
    def sync_with_dataloader(self) -> bool:
        return self.plugin.sync_with_dataloader

    @property
    def sync_each_batch(self) -> bool:
        return self.plugin.sync_each_batch

    @property
    def end_of_dataloader(self) -> bool:
        """Whether the batch being processed is the last of the active dataloader."""
        return bool(getattr(self.active_dataloader, "end_of_dataloader", False))

    @property
    def remainder(self) -> int:
        """Real samples in the last global batch (``-1`` when unknown, ``0`` when it is full)."""
        return int(getattr(self.active_dataloader, "remainder", -1))

    @property
    def in_dataloader(self) -> bool:
        """Whether a prepared dataloader is being iterated."""
        return self.active_dataloader is not None

    @classmethod
    def _reset_state(cls) -> None:
        """Accelerate's ``GradientState._reset_state()``: here a no-op, since nothing is shared.

        Accelerate keeps one gradient state per process; nbaccel gives each ``Accelerator`` its
        own, so a new ``Accelerator`` always starts from a fresh one.
        """

    def _set_sync_gradients(self, value: bool) -> None:
        self.sync_gradients = value
        self.is_xla_gradients_synced = False

    def _add_dataloader(self, loader: Any) -> None:
        self._references.append(weakref.ref(loader))

    def _remove_dataloader(self, loader: Any) -> None:
        # drop this loader's entries and those of loaders already freed
        self._references = [None] + [ref for ref in self._references[1:]
                                     if ref is not None and ref() is not None and ref() is not loader]

    def __repr__(self) -> str:
        return (f"GradientState(num_steps={self.num_steps}, sync_gradients={self.sync_gradients}, "
                f"end_of_dataloader={self.end_of_dataloader}, remainder={self.remainder})")
