"""What kind of file a path names, so nothing but regular files is ever read.

Opening a FIFO for reading blocks until a writer comes (forever, and inside C code that Ctrl-C
cannot reach); reading a character device (``/dev/zero``) never ends; a directory fails deep
inside a library with an error that does not say which path. Every reader of user-named files
(config files, checkpoints, training states) opens the file once through :func:`regular_file`:
``O_NONBLOCK`` (so the open itself never waits for a FIFO's writer), then ``fstat`` on that
descriptor, refusing by name anything that is not a regular file. What is read is the file that
was checked: the reader is handed ``/proc/self/fd/<n>``, which names the open file whatever is
renamed over the path meanwhile (a check by path, then an open by path, let a FIFO swapped in
between block the load). Symbolic links are followed, as before: a link to a regular file is one
(the Hugging Face cache is made of them). Where ``/proc`` is missing (not Linux) the path is
handed on after the check.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator

from nbaccel.errors import CheckpointError

__all__ = ["kind_of_mode", "regular_file"]

_KINDS = ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO (named pipe)"), (stat.S_ISCHR, "character device"),
          (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"))


def kind_of_mode(mode: int) -> str | None:
    """``None`` for a regular file's ``st_mode``, else what it is, in words.

    Example:
        >>> import stat
        >>> kind_of_mode(stat.S_IFIFO | 0o600)
        'FIFO (named pipe)'
    """
    if stat.S_ISREG(mode):
        return None
    for test, name in _KINDS:
        if test(mode):
            return name
    return "special file"


def _not_regular(path: str | os.PathLike[str], kind: str) -> CheckpointError:
    return CheckpointError(f"checkpoint file {path} is not a regular file (it is a {kind}); nothing was read "
                           "from it. Fix: point to the checkpoint's real file (a FIFO or device cannot hold one).",
                           path=str(path))


@contextlib.contextmanager
def regular_file(path: str | os.PathLike[str]) -> Iterator[str]:
    """Open ``path`` once without blocking, check the descriptor, and yield a path that names that open file.

    Raises:
        CheckpointError: ``path`` is a directory, FIFO, device or socket (``error.path`` names it).
        FileNotFoundError: ``path`` does not exist (each caller words its own message).

    Example:
        >>> with regular_file(__file__) as name:
        ...     name.startswith("/proc/self/fd/") or name == __file__
        True
    """
    try:  # O_NONBLOCK: a FIFO must not block the open itself; O_NOCTTY: a terminal must not become ours
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        if exc.errno != errno.ENXIO:  # what opening a Unix socket gives
            raise
        raise _not_regular(path, "socket") from None
    try:
        kind = kind_of_mode(os.fstat(fd).st_mode)
        if kind is not None:
            raise _not_regular(path, kind)
        os.set_blocking(fd, True)
        pinned = f"/proc/self/fd/{fd}"
        yield pinned if os.path.exists(pinned) else os.fspath(path)
    finally:
        os.close(fd)
