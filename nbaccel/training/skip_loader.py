"""`SkipDataLoader`: a plain ``DataLoader`` that loads and drops its first batches (Accelerate's name).

For loaders whose batches cannot be skipped without loading them (iterable datasets, or no batch
sampler); :func:`~nbaccel.training.loader_preparation.skip_first_batches` skips through the batch
sampler instead where it can, so nothing is loaded for the skipped batches.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset

from nbaccel.errors import ConfigError

__all__ = ["BaseDataloader", "SkipDataLoader"]


class BaseDataloader:
    """Accelerate's ``loader.base_dataloader``: there a wrapped ``DataLoader``; nbaccel's loaders are one, so itself.

    An attribute of a loader, not of its class (``DataLoaderShard.base_dataloader`` raises
    ``AttributeError``, as in Accelerate).

    Example:
        >>> loader = SkipDataLoader(range(4), batch_size=2)
        >>> loader.base_dataloader is loader
        True
    """

    def __get__(self, loader: DataLoader | None, owner: type | None = None) -> DataLoader:
        if loader is None:
            name = owner.__name__ if owner is not None else "DataLoader"
            raise AttributeError(f"'{name}.base_dataloader' is an attribute of a loader, not of the class")
        return loader


class SkipDataLoader(DataLoader):
    """A ``DataLoader`` whose iteration starts after its first ``skip_batches`` batches.

    Differs from Accelerate: ``use_stateful_dataloader`` (torchdata's ``StatefulDataLoader``) is
    not supported; passing ``True`` is refused.

    Args:
        dataset: the dataset.
        skip_batches: the batches to drop at the start of every iteration.
        use_stateful_dataloader: must be ``False``.
        **kwargs: the ``DataLoader`` arguments.

    Raises:
        ConfigError: ``skip_batches`` is negative, or ``use_stateful_dataloader=True``.

    Example:
        >>> [b.tolist() for b in SkipDataLoader(range(6), skip_batches=2, batch_size=2)]
        [[4, 5]]
    """

    def __init__(self, dataset: Dataset, skip_batches: int = 0, use_stateful_dataloader: bool = False,
                 **kwargs: Any) -> None:
        if not isinstance(skip_batches, int) or isinstance(skip_batches, bool) or skip_batches < 0:
            raise ConfigError(f"`skip_batches` must be an int >= 0 (got {skip_batches!r}). Fix: pass the number of "
                              "batches already seen, e.g. skip_batches=10.", key="skip_batches",
                              value=skip_batches, valid="int >= 0")
        if use_stateful_dataloader:
            raise ConfigError("`use_stateful_dataloader=True` is not supported by nbaccel (torchdata's "
                              "StatefulDataLoader is not used). Fix: drop the argument; resume with skip_batches.",
                              key="use_stateful_dataloader", value=True, valid=(False,))
        super().__init__(dataset, **kwargs)
        self.skip_batches = skip_batches

    base_dataloader = BaseDataloader()

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # torch types it as a private iterator class
        for index, batch in enumerate(super().__iter__()):
            if index >= self.skip_batches:
                yield batch

    def __len__(self) -> int:
        return max(super().__len__() - self.skip_batches, 0)
