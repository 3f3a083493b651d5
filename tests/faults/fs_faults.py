"""Fault injection for ``save_state``: a crash before the n-th filesystem step.

:class:`FilesystemSteps` wraps every call that changes the filesystem during a save
(``os.mkdir``, ``os.rename``, ``os.replace``, ``os.unlink``, ``os.rmdir``, ``os.fsync``,
``open`` for writing (builtins' and io's), ``torch.save`` and safetensors' ``save_file``) and, before the n-th one,
either raises :class:`Crash` (a ``BaseException``: no ``except Exception`` in nbaccel stops it, so
nothing tidies up, as after a kill) or SIGKILLs the process. Counting runs only while armed.
"""

from __future__ import annotations

import builtins
import io
import os
import signal
from collections.abc import Callable
from typing import Any

import safetensors.torch
import torch


class Crash(BaseException):
    """The process 'died' here."""


_WRAPPED = [(os, "mkdir"), (os, "rename"), (os, "replace"), (os, "unlink"), (os, "rmdir"), (os, "fsync"),
            (torch, "save"), (safetensors.torch, "save_file"), (builtins, "open"), (io, "open")]


class FilesystemSteps:
    """Counts filesystem steps while armed; crashes before step ``crash_at`` (1-based), if given.

    Args:
        crash_at: the step to die before; ``None`` only records the steps.
        kill: SIGKILL the process instead of raising :class:`Crash`.
    """

    def __init__(self, crash_at: int | None = None, kill: bool = False) -> None:
        self.crash_at = crash_at
        self.kill = kill
        self.steps: list[str] = []
        self._originals: list[tuple[Any, str, Callable[..., Any]]] = []

    def _wrap(self, owner: Any, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def step(*args: Any, **kwargs: Any) -> Any:
            if name == "open":
                mode = args[1] if len(args) > 1 else kwargs.get("mode", "r")
                if not any(c in mode for c in "wax+"):
                    return original(*args, **kwargs)
            target = args[1] if name in ("save", "save_file") else args[0]
            self.steps.append(f"{name} {os.path.basename(str(target))}")
            if len(self.steps) == self.crash_at:
                if self.kill:
                    os.kill(os.getpid(), signal.SIGKILL)
                raise Crash(self.steps[-1])
            return original(*args, **kwargs)

        return step

    def __enter__(self) -> FilesystemSteps:
        for owner, name in _WRAPPED:
            original = getattr(owner, name)
            self._originals.append((owner, name, original))
            setattr(owner, name, self._wrap(owner, name, original))
        return self

    def __exit__(self, *exc: object) -> bool:
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
        self._originals.clear()
        return exc[0] is Crash  # a crash is the expected outcome


def count_steps(save: Callable[[], Any]) -> list[str]:
    """The filesystem steps ``save()`` takes, in order."""
    with FilesystemSteps() as steps:
        save()
    return steps.steps
