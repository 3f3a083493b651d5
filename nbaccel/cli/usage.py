"""`UsageError`: a command-line mistake; its own module, so subcommands raise it without importing ``main``."""

from __future__ import annotations

__all__ = ["UsageError"]


class UsageError(Exception):
    """A command-line mistake: printed as one line, exit code 2.

    Attributes:
        prog: the command it belongs to (``"nbaccel launch"``).
    """

    def __init__(self, msg: str, *, prog: str = "nbaccel") -> None:
        super().__init__(msg)
        self.prog = prog
