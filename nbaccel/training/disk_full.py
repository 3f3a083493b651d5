"""Telling a full disk apart from other write failures of ``save_state``, and saying so plainly.

What a full disk looks like depends on the writer: safetensors raises ``No space left on device
(os error 28)``; ``torch.save`` raises ``[enforce fail at inline_container.cc:672] . unexpected pos
576 vs 534`` (an ``iostream error`` underneath, no errno at all). So a failed write counts as a
full disk when its exception chain carries ``ENOSPC``/``EDQUOT`` or says so, or when the
filesystem has under :data:`FULL_BELOW` bytes free right after the failure.

What always holds when :func:`disk_full_error` returns an error: the partial copy is gone (it
was what kept the disk full, so every retry failed the same way), and the error carries the
checkpoint's path, about how many bytes it needs and how many are free now.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from nbaccel.errors import CheckpointDiskFullError

__all__ = ["FULL_BELOW", "disk_full_error"]

FULL_BELOW = 1 << 20
"""A filesystem with less than this free (1 MiB) right after a write failed is full."""

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_TEXT = ("No space left on device", "Disk quota exceeded")


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _free_bytes(path: Path) -> int | None:
    for candidate in (path, *path.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None


def _tree_bytes(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total


def _says_full(exc: BaseException) -> bool:
    for link in _chain(exc):
        if isinstance(link, OSError) and link.errno in _FULL_ERRNOS:
            return True
        if any(text in str(link) for text in _FULL_TEXT):
            return True
    return False


def disk_full_error(exc: BaseException, partial: Path, folder: Path,
                    remove: Callable[[Path], None]) -> CheckpointDiskFullError | None:
    """The error to raise for ``exc`` if writing ``partial`` (the copy of ``folder`` being written) filled the disk.

    Returns ``None`` (and removes nothing) when the disk is not full: ``exc`` is some other failure.
    Otherwise ``remove(partial)`` is called first, so the space it held is free again.

    Example:
        >>> import tempfile
        >>> tmp = Path(tempfile.mkdtemp())
        >>> full = disk_full_error(OSError(errno.ENOSPC, "No space left on device"), tmp / "p", tmp / "c",
        ...                        remove=lambda partial: None)
        >>> full.path == str(tmp / "c"), "the disk is full" in str(full)
        (True, True)
    """
    if not _says_full(exc):
        free = _free_bytes(partial)
        if free is None or free >= FULL_BELOW:
            return None
    written = _tree_bytes(partial) if partial.exists() else 0
    previous = _tree_bytes(folder) if folder.is_dir() else 0
    remove(partial)
    free = _free_bytes(folder) or 0
    needed = max(previous, written)
    about = (f"about {needed:,} bytes (the size of the previous checkpoint)" if previous >= written else
             f"at least {needed:,} bytes (what was written before the disk filled)")
    kept = f"the previous checkpoint at {str(folder)!r} is intact" if previous else "no earlier checkpoint was there"
    msg = (f"save_state could not write the checkpoint {str(folder)!r}: the disk is full. It needs {about}; "
           f"{free:,} bytes are free there now. The partial copy was removed and {kept}. Fix: free at least "
           f"{max(needed - free, 0):,} more bytes on that filesystem (or save elsewhere with output_dir=...), "
           "then call save_state again.")
    return CheckpointDiskFullError(msg, path=str(folder), bytes_needed=needed, bytes_free=free)
