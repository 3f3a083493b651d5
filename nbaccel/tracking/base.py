"""`GeneralTracker`, `LoggerType` and `on_main_process`: what every experiment tracker is built on.

Accelerate's tracker protocol, kept as it is so custom trackers written for Accelerate work here:
a tracker has a ``name``, says whether it ``requires_logging_directory``, exposes the library's own
object as ``tracker``, and implements ``start``, ``store_init_configuration``, ``log`` and
``finish``. With ``main_process_only = True`` (the default) the methods decorated with
:func:`on_main_process` run on the main process only and return ``None`` elsewhere.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from typing import Any, TypeVar

from nbaccel.identity import current_identity

__all__ = ["GeneralTracker", "LoggerType", "on_main_process"]

F = TypeVar("F", bound=Callable[..., Any])


class LoggerType(str, enum.Enum):
    """The trackers nbaccel knows by name (Accelerate's names, plus ``"notebook"``).

    ``"all"`` means every tracker whose library is installed. Accelerate's ``aim``, ``comet_ml``,
    ``clearml``, ``dvclive`` and ``swanlab`` are not built in; pass a :class:`GeneralTracker`
    instance for those.

    Example:
        >>> LoggerType("tensorboard") is LoggerType.TENSORBOARD
        True
    """

    ALL = "all"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    MLFLOW = "mlflow"
    TRACKIO = "trackio"
    NOTEBOOK = "notebook"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def list(cls) -> list[str]:
        """Every name, as Accelerate's ``LoggerType.list()``."""
        return [member.value for member in cls]


def is_main_process() -> bool:
    """Whether the calling worker (or plain process) is global rank 0."""
    identity = current_identity()
    return identity is None or identity.is_main


def on_main_process(function: F) -> F:
    """Run a tracker method on the main process only, when its tracker says ``main_process_only``.

    Decided at each call (not at decoration), so a tracker built before the job is known still
    follows the rule; elsewhere the method returns ``None``.

    Example:
        >>> class Printer(GeneralTracker):
        ...     name, requires_logging_directory = "printer", False
        ...     tracker = None
        ...     @on_main_process
        ...     def log(self, values, step=None, **kwargs):
        ...         print(step, values)
        >>> Printer().log({"loss": 0.5}, step=1)
        1 {'loss': 0.5}
    """

    @functools.wraps(function)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "main_process_only", True) and not is_main_process():
            return None
        return function(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]  # functools.wraps keeps the signature


class GeneralTracker:
    """The base of every tracker: subclass it to log somewhere nbaccel does not know.

    A subclass sets ``name`` (a string, what ``get_tracker`` and ``log_kwargs`` key on),
    ``requires_logging_directory`` (``True``: built with the Accelerator's logging directory),
    and a ``tracker`` attribute or property (the library's own run or writer object). Pass an
    instance in ``Accelerator(log_with=[...])``; ``init_trackers`` then calls ``start`` and
    ``store_init_configuration`` on it, ``log`` goes to its ``log``, ``end_training`` to ``finish``.

    Attributes:
        main_process_only: run the :func:`on_main_process`-decorated methods on rank 0 only.

    Raises:
        NotImplementedError: the subclass lacks ``name``, ``requires_logging_directory`` or
            ``tracker`` (Accelerate's check, with the same message).

    Example:
        >>> class ListTracker(GeneralTracker):
        ...     name, requires_logging_directory = "list", False
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.rows = []
        ...     @property
        ...     def tracker(self):
        ...         return self.rows
        ...     @on_main_process
        ...     def log(self, values, step=None, **kwargs):
        ...         self.rows.append((step, values))
        >>> t = ListTracker(); t.log({"loss": 1.0}, step=0); t.tracker
        [(0, {'loss': 1.0})]
    """

    main_process_only = True
    name: str  # set by each subclass, as is requires_logging_directory (checked in __init__)
    requires_logging_directory: bool

    def __init__(self, _blank: bool = False) -> None:
        if _blank:
            return
        missing = [f"`{attr}`" for attr in ("name", "requires_logging_directory") if not hasattr(self, attr)]
        if "tracker" not in dir(self):
            missing.append("`tracker`")
        if missing:
            raise NotImplementedError(
                f"The implementation for this tracker class is missing the following required attributes. "
                f"Please define them in the class definition: {', '.join(missing)}")

    def start(self) -> None:
        """Open the run (called by ``init_trackers``, after the job is known)."""

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Record ``values`` as the run's hyperparameters."""

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Record ``values`` at ``step``."""

    def finish(self) -> None:
        """Close the run and flush what it holds."""
