"""What kind of file a path names, found without opening it, so nothing but regular files is ever read.

Opening a FIFO for reading blocks until a writer comes (forever, and inside C code that Ctrl-C
cannot reach); reading a character device (``/dev/zero``) never ends; a directory fails deep
inside a library with an error that does not say which path. Every reader of user-named files
(config files, checkpoints, training states) asks :func:`special_kind` first and refuses, by
name, anything that is not a regular file (symbolic links are followed: a link to a regular file
is one).
"""

from __future__ import annotations

import os
import stat

from nbaccel.errors import CheckpointError

__all__ = ["kind_of_mode", "refuse_special", "special_kind"]

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


def special_kind(path: str | os.PathLike[str]) -> str | None:
    """``None`` when ``path`` is a regular file (or does not exist), else what it is, in words.

    ``os.stat`` never blocks on a FIFO; a missing path is left to the caller's own message.

    Example:
        >>> special_kind("/dev/null"), special_kind("/"), special_kind(__file__)
        ('character device', 'directory', None)
    """
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    return kind_of_mode(mode)


def refuse_special(path: str | os.PathLike[str]) -> None:
    """Raise unless ``path`` is a regular file (or missing): a FIFO would block every read, forever.

    Raises:
        CheckpointError: ``path`` is a directory, FIFO, device or socket (``error.path`` names it).

    Example:
        >>> refuse_special("/dev/zero")
        Traceback (most recent call last):
        ...
        nbaccel.errors.CheckpointError: checkpoint file /dev/zero is not a regular file (it is a character device)...
    """
    kind = special_kind(path)
    if kind is not None:
        raise CheckpointError(f"checkpoint file {path} is not a regular file (it is a {kind}); nothing was read "
                              "from it. Fix: point to the checkpoint's real file (a FIFO or device cannot hold one).",
                              path=str(path))
