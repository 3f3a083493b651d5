"""Prepared loaders on XLA: batches fed through torch_xla's ``MpDeviceLoader``, bookkeeping kept in the replica.

``MpDeviceLoader`` copies batches to the device on a background thread, reading well ahead of the
training loop; :class:`XlaDeviceLoader` lets that thread only read, and advances the pass's
bookkeeping in the replica's own thread as each batch reaches the loop.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

from nbaccel.nested_data import send_to_device
from nbaccel.training.data_loader import DataLoaderDispatcher, DataLoaderShard

__all__ = ["XlaDeviceLoader"]


class XlaDeviceLoader:
    """On XLA, a prepared loader fed through ``MpDeviceLoader`` (background host-to-device copies).

    ``MpDeviceLoader``'s thread reads batches well ahead of the training loop, so only the reading
    happens there: the pass's bookkeeping (``end_of_dataloader``, ``remainder``, the epoch count,
    the accelerator's active loader) advances here, in the replica's thread, as each batch is
    handed to the loop. A dispatching loader (``dispatch_batches``, the default for an
    ``IterableDataset`` across replicas) runs collectives while it reads, which need the replica's
    identity, so it is read in the replica's thread too, without the background copies.
    Everything else (``set_epoch``, ``state_dict``, ...) is the wrapped :class:`DataLoaderShard`'s.
    """

    def __init__(self, loader: DataLoaderShard, device: torch.device) -> None:
        self._loader = loader
        self.device = device

    def __iter__(self) -> Iterator[Any]:
        loader = self._loader
        if isinstance(loader, DataLoaderDispatcher):
            for batch in loader:
                yield send_to_device(batch, self.device)
            return
        import torch_xla.distributed.parallel_loader as pl

        lasts: deque[bool] = deque()  # one entry per batch read, appended before the batch is passed on
        loader._start_pass()
        try:
            for batch in pl.MpDeviceLoader(_Reading(loader, lasts), self.device):
                if lasts.popleft():
                    loader._mark_last()
                yield batch
            loader._end_pass()
        finally:
            loader.gradient_state._remove_dataloader(loader)

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_loader"], name)


class _Reading:
    """What ``MpDeviceLoader``'s thread iterates: the loader's batches, their last-batch flags set aside."""

    def __init__(self, loader: DataLoaderShard, lasts: deque[bool]) -> None:
        self._loader = loader
        self._lasts = lasts

    def __iter__(self) -> Iterator[Any]:
        for batch, last in self._loader._batches():
            self._lasts.append(last)
            yield batch

    def __len__(self) -> int:
        return len(self._loader)
