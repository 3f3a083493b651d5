"""Which trackers a run logs to: ``log_with`` resolved, checked, and turned into tracker objects.

The built-in trackers, each in its own module and imported only when used::

    name          class                  library imported       pip extra
    tensorboard   TensorBoardTracker     torch.utils.tensorboard  nbaccel[tensorboard]
    mlflow        MLflowTracker          mlflow                  nbaccel[mlflow]
    wandb         WandBTracker           wandb (offline)         nbaccel[wandb]
    trackio       TrackioTracker         trackio                 nbaccel[trackio]
    notebook      NotebookTracker        (none: the launch's control pipe)

Where nbaccel differs from Accelerate: a tracker named explicitly whose library is missing is an
error naming the extra to install (Accelerate drops it with a debug log, so nothing is logged and
nothing says why); ``"all"`` still picks only the installed ones.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from nbaccel.errors import ConfigError, MissingDependencyError
from nbaccel.tracking.base import GeneralTracker, LoggerType

__all__ = ["TrackerSpec", "available_trackers", "build_tracker", "resolve_log_with"]

TrackerSpec = LoggerType | GeneralTracker


@dataclass(frozen=True)
class _Builtin:
    module: str
    class_name: str
    package: str | None  # what must be importable; None: nothing beyond nbaccel
    extra: str | None


_BUILTINS: dict[LoggerType, _Builtin] = {
    LoggerType.TENSORBOARD: _Builtin("nbaccel.tracking.tensorboard_tracker", "TensorBoardTracker", "tensorboard",
                                     "tensorboard"),
    LoggerType.MLFLOW: _Builtin("nbaccel.tracking.mlflow_tracker", "MLflowTracker", "mlflow", "mlflow"),
    LoggerType.WANDB: _Builtin("nbaccel.tracking.wandb_tracker", "WandBTracker", "wandb", "wandb"),
    LoggerType.TRACKIO: _Builtin("nbaccel.tracking.trackio_tracker", "TrackioTracker", "trackio", "trackio"),
    LoggerType.NOTEBOOK: _Builtin("nbaccel.tracking.notebook_tracker", "NotebookTracker", None, None),
}


def _installed(package: str | None) -> bool:
    if package is None:
        return True
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module without a spec
        return False


def available_trackers() -> list[LoggerType]:
    """The library-backed trackers whose library is installed (what ``log_with="all"`` picks).

    Example:
        >>> set(available_trackers()) <= {LoggerType.TENSORBOARD, LoggerType.MLFLOW, LoggerType.WANDB,
        ...                               LoggerType.TRACKIO}
        True
    """
    return [kind for kind, b in _BUILTINS.items() if b.package is not None and _installed(b.package)]


def _as_logger_type(value: Any) -> LoggerType:
    try:  # a str, this LoggerType, or Accelerate's (its members print as their value too)
        kind = LoggerType(str(value).lower()) if isinstance(value, str) else None
    except ValueError:
        kind = None
    if kind is None or kind is LoggerType.ALL:
        raise ConfigError(
            f"log_with names an unknown tracker {value!r} (a {type(value).__name__}). Valid names: "
            f"{LoggerType.list()}, or a GeneralTracker instance. Fix: log_with='tensorboard', or subclass "
            "nbaccel.tracking.GeneralTracker for another tracking library.", key="log_with", value=value,
            valid=LoggerType.list())
    return kind


def _is_all(value: Any) -> bool:
    return isinstance(value, str) and str(value).lower() == "all"


def _check_installed(kind: LoggerType) -> None:
    builtin = _BUILTINS[kind]
    if not _installed(builtin.package):
        install = f"pip install 'nbaccel[{builtin.extra}]'"
        raise MissingDependencyError(
            f"log_with={kind.value!r} needs the {builtin.package} package, which is not installed. Fix: "
            f"{install} (or pip install {builtin.package}), then restart the kernel; or drop {kind.value!r} "
            "from log_with.", package=str(builtin.package), needed_for=f"log_with={kind.value!r}", install=install)


def resolve_log_with(log_with: Any, logging_dir: str | None, *, notebook: bool) -> list[TrackerSpec]:
    """The trackers a run uses: built-in kinds and custom instances, each once, in the order given.

    Args:
        log_with: ``None``, a name, a :class:`LoggerType`, a :class:`GeneralTracker`, or a list of them.
        logging_dir: the Accelerator's logging directory (trackers that write files need one).
        notebook: add the notebook tracker (true inside an nbaccel launch, unless turned off).

    Raises:
        ConfigError: an unknown name, or a tracker that needs a logging directory without one.
        MissingDependencyError: a tracker named explicitly whose library is not installed.

    Example:
        >>> resolve_log_with(None, None, notebook=True)
        [<LoggerType.NOTEBOOK: 'notebook'>]
    """
    given: Sequence[Any] = [] if log_with is None else (
        list(log_with) if isinstance(log_with, (list, tuple)) else [log_with])
    chosen: list[TrackerSpec] = []
    wants_all = any(_is_all(v) for v in given)
    for value in given:
        if isinstance(value, GeneralTracker):
            chosen.append(value)
        elif isinstance(value, type) and issubclass(value, GeneralTracker):
            raise ConfigError(f"log_with got the class {value.__name__}, not an instance. Fix: "
                              f"log_with=[{value.__name__}(...)]", key="log_with", value=value,
                              valid="a GeneralTracker instance")
        elif not _is_all(value):
            kind = _as_logger_type(value)
            if kind not in chosen:
                _check_installed(kind)
                chosen.append(kind)
    if wants_all:
        chosen += [kind for kind in available_trackers() if kind not in chosen]
    if notebook and LoggerType.NOTEBOOK not in chosen:
        chosen.append(LoggerType.NOTEBOOK)
    for spec in chosen:
        if isinstance(spec, LoggerType) and _tracker_class(spec).requires_logging_directory and logging_dir is None:
            raise ConfigError(
                f"log_with={spec.value!r} writes files and needs a logging directory, but none was given. Fix: "
                f"Accelerator(log_with={spec.value!r}, project_dir='runs') (or ProjectConfiguration(logging_dir=...))",
                key="project_dir", value=None, valid="a directory path")
    return chosen


class _BuiltinTrackerClass(Protocol):
    """A built-in tracker's class: each takes its own arguments (the run name first, then the logging dir)."""

    requires_logging_directory: bool

    def __call__(self, *args: Any, **kwargs: Any) -> GeneralTracker: ...


def _tracker_class(kind: LoggerType) -> _BuiltinTrackerClass:
    builtin = _BUILTINS[kind]
    return getattr(importlib.import_module(builtin.module), builtin.class_name)


def build_tracker(spec: TrackerSpec, project_name: str, logging_dir: str | None,
                  init_kwargs: Mapping[str, Mapping[str, Any]]) -> GeneralTracker:
    """The tracker object for ``spec`` (custom instances come back as they are; nothing started yet).

    Raises:
        ConfigError: ``init_kwargs`` for this tracker is not a dict.
    """
    if isinstance(spec, GeneralTracker):
        return spec
    kwargs = init_kwargs.get(spec.value, {})
    if not isinstance(kwargs, Mapping):
        raise ConfigError(f"init_kwargs[{spec.value!r}] must be a dict of keyword arguments for the tracker (got "
                          f"{kwargs!r}). Fix: init_kwargs={{{spec.value!r}: {{...}}}}", key="init_kwargs",
                          value=kwargs, valid="dict")
    cls = _tracker_class(spec)
    if cls.requires_logging_directory:
        return cls(project_name, logging_dir, **kwargs)
    return cls(project_name, logging_dir=logging_dir, **kwargs)
