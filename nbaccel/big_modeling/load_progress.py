"""The "Loading checkpoint shards" bar: one step per checkpoint file whose tensors are all loaded.

Shown only for a checkpoint of more than one file, only when asked (``show_progress``, on by
default as in Transformers, whose ``from_pretrained`` shows the same bar and turns it off only
globally), and only once the load has taken :data:`DELAY_S` (as tqdm's ``delay``): a load of
mapped files that takes 50 ms neither flashes a bar nor pays for one. The bar is
``tqdm.auto``'s: a widget in a notebook with ipywidgets, text on stderr in a terminal or a log.
Without tqdm installed there is no bar. What always holds: a key counts once however often it is
reported (tied aliases, a key read for two devices); reports may come from any thread (the
readers report each key as its bytes land, and a file's last key sets :attr:`ShardProgress.moved`
to wake the caller), but only the thread that made the object (the caller's) creates and moves
the bar, in :meth:`tick`, so the bar moves while the readers run, one step per file; the bar is
closed when the load ends, also by an error.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any

__all__ = ["DELAY_S", "DESCRIPTION", "ShardProgress"]

DESCRIPTION = "Loading checkpoint shards"  # Transformers' wording, so logs read the same
DELAY_S = 0.5  # no bar for loads shorter than this


class ShardProgress:
    """Counts a checkpoint's files as their wanted keys are reported done.

    Args:
        file_of: ``{checkpoint key: file}`` for every key the load reads.
        show: show a bar (when there is more than one file and tqdm is installed).

    Example:
        >>> with ShardProgress({"a": "1.safetensors", "b": "2.safetensors"}, show=False) as bar:
        ...     bar.done("a"); bar.done("a"); bar.done("b"); bar.tick()
        >>> bar.finished
        2
    """

    def __init__(self, file_of: Mapping[str, str], show: bool = True) -> None:
        self._left: dict[str, set[str]] = {}
        for key, file in file_of.items():
            self._left.setdefault(file, set()).add(key)
        self._file_of = dict(file_of)
        self._lock = threading.Lock()
        self._wanted = show and len(self._left) > 1
        self._start = time.monotonic()
        self.finished = 0
        self.bar: Any = None
        self.moved = threading.Event()  # set when a file is done: the caller's wait wakes to draw

    def done(self, key: str) -> None:
        """Report ``key`` loaded; its file's step is taken when it was the file's last key."""
        file = self._file_of.get(key)
        with self._lock:
            left = self._left.get(file) if file is not None else None
            if left is None or key not in left:
                return
            left.discard(key)
            if not left:
                self.finished += 1
                self.moved.set()

    def tick(self) -> None:
        """Show the bar once the load has taken :data:`DELAY_S`, and move it to the files done
        (call it from the thread that made this object)."""
        if not self._wanted:
            return
        if self.bar is None:
            if time.monotonic() - self._start < DELAY_S:
                return
            self.bar = _bar(len(self._left))
            if self.bar is None:  # no tqdm
                self._wanted = False
                return
        if self.finished > self.bar.n:
            self.bar.update(self.finished - self.bar.n)

    def done_all(self, keys: Iterable[str]) -> None:
        """Report several keys loaded."""
        for key in keys:
            self.done(key)

    def close(self) -> None:
        """Bring a shown bar up to date and close it (it stays on screen as it is)."""
        if self.bar is not None:
            self.tick()
            self.bar.close()

    def __enter__(self) -> ShardProgress:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()


def _bar(total: int) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional: no bar
        return None
    # mininterval=0: a step per file is few redraws, and each one is news (tqdm's 0.1 s default
    # would drop the steps of files that finish close together)
    return tqdm(total=total, desc=DESCRIPTION, unit="shard", mininterval=0)
