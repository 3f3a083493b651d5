"""`DataLoaderStateMixin`: the end-of-data flags a prepared loader shares with its gradient state.

A loader with this mixin has ``end_of_dataloader`` (the batch being yielded is the last) and
``remainder`` (real samples in the last global batch; ``-1`` unknown), and registers itself with its
``gradient_state`` for one pass (:meth:`begin` .. :meth:`end`), as Accelerate's loaders do, so that
``gather_for_metrics`` and gradient accumulation can read them. nbaccel's own loaders have it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DataLoaderStateMixin"]


class DataLoaderStateMixin:
    """Mix into a ``DataLoader`` that has ``gradient_state`` and ``total_batch_size``.

    Example:
        >>> from torch.utils.data import DataLoader
        >>> from nbaccel.training.gradient_state import GradientState
        >>> class Tracked(DataLoader, DataLoaderStateMixin):
        ...     gradient_state, total_batch_size, _drop_last = GradientState(), 4, False
        >>> loader = Tracked(list(range(10)), batch_size=4)
        >>> loader.begin(); (loader.remainder, loader.gradient_state.in_dataloader)
        (2, True)
        >>> loader.end(); loader.gradient_state.in_dataloader
        False
    """

    end_of_dataloader: bool = False
    remainder: int = -1

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.end_of_dataloader = False
        cls.remainder = -1

    def reset(self) -> None:
        """Forget the flags of the last pass."""
        self.end_of_dataloader = False
        self.remainder = -1

    def begin(self) -> None:
        """Start a pass: reset the flags, work out the remainder where the length is known, register."""
        self.reset()
        drop_last = getattr(self, "_drop_last", getattr(self, "drop_last", False))
        total = getattr(self, "total_batch_size", None)
        if not drop_last and total:
            try:
                length = getattr(self.dataset, "total_dataset_length", None) or len(self.dataset)  # type: ignore[attr-defined]  # the DataLoader's, mixed into
                self.remainder = length % total
            except TypeError:  # an iterable dataset without a length
                pass
        self.gradient_state._add_dataloader(self)  # type: ignore[attr-defined]  # set by the loader class

    def end(self) -> None:
        """End a pass: the gradient state forgets this loader."""
        self.gradient_state._remove_dataloader(self)  # type: ignore[attr-defined]  # set by the loader class
