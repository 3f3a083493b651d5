"""`TrackingHelpers`: the Accelerator's experiment-tracking methods, with Accelerate's names and rules.

``Accelerator(log_with=..., project_dir=...)`` chooses the trackers
(:func:`~nbaccel.tracking.selection.resolve_log_with`); ``init_trackers`` builds them on every
process and starts them (each tracker's own methods run on the main process only);
``log`` runs on the main process only; ``end_training`` finishes them. Where nbaccel differs:

- inside an nbaccel launch the notebook tracker is added (``notebook_tracker=False`` turns it
  off), and ``log`` reaches it even before ``init_trackers`` is called, so the launching cell
  charts ``accelerator.log`` calls from any training loop;
- a tracker named in ``log_with`` whose library is missing is an error naming the extra;
- ``end_training`` waits for every process but leaves the process group up (the launch tears it
  down after the function returns, once models are freed; destroying gloo under a live DDP
  model can deadlock).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

from nbaccel.errors import ConfigError
from nbaccel.launch.worker.channel import current_channel
from nbaccel.tracking.base import GeneralTracker, LoggerType, is_main_process
from nbaccel.tracking.notebook_tracker import NotebookTracker
from nbaccel.tracking.selection import TrackerSpec, build_tracker, resolve_log_with

__all__ = ["TrackingHelpers"]


class TrackingHelpers:
    """Mixed into :class:`~nbaccel.Accelerator`: ``init_trackers``, ``log``, ``get_tracker``, ``end_training``.

    Attributes:
        log_with: the trackers chosen (:class:`LoggerType` members and custom instances).
        trackers: the started trackers (empty until ``init_trackers``).
    """

    project_configuration: Any
    log_with: list[TrackerSpec]
    trackers: list[GeneralTracker]

    if TYPE_CHECKING:  # ProcessHelpers', beside this in the Accelerator
        def wait_for_everyone(self) -> None: ...

    def _setup_tracking(self, log_with: Any, notebook_tracker: bool) -> None:
        self.log_with = resolve_log_with(log_with, self.logging_dir,
                                         notebook=notebook_tracker and current_channel() is not None)
        self.trackers = []
        self._implicit_notebook: NotebookTracker | None = None

    @property
    def logging_dir(self) -> str | None:
        """Where trackers that write files put them (``ProjectConfiguration.logging_dir``)."""
        return self.project_configuration.logging_dir

    def init_trackers(self, project_name: str, config: dict[str, Any] | None = None,
                      init_kwargs: dict[str, dict[str, Any]] | None = None) -> None:
        """Start every tracker in ``log_with`` for ``project_name`` and record ``config``.

        Args:
            project_name: the run's project (TensorBoard's sub-folder, MLflow's experiment, ...).
            config: hyperparameters to store with the run.
            init_kwargs: ``{tracker name: keyword arguments for it}``, e.g. ``{"wandb": {"tags": ["a"]}}``.

        Raises:
            ConfigError: ``project_name`` is not a string, or ``init_kwargs`` is not a dict of dicts.

        Example:
            >>> accelerator = Accelerator(log_with="tensorboard", project_dir="runs")   # doctest: +SKIP
            >>> accelerator.init_trackers("demo", config={"lr": 1e-3},                  # doctest: +SKIP
            ...                           init_kwargs={"tensorboard": {"flush_secs": 5}})
        """
        if not isinstance(project_name, str):
            raise ConfigError(f"project_name must be a str (got {project_name!r}, a {type(project_name).__name__}). "
                              "Fix: accelerator.init_trackers('my_project')", key="project_name",
                              value=project_name, valid="str")
        init_kwargs = {} if init_kwargs is None else init_kwargs
        if not isinstance(init_kwargs, Mapping):
            raise ConfigError(f"init_kwargs must be a dict of {{tracker name: dict}} (got {init_kwargs!r}). Fix: "
                              "init_kwargs={'tensorboard': {'flush_secs': 5}}", key="init_kwargs",
                              value=init_kwargs, valid="dict")
        trackers = [build_tracker(spec, project_name, self.logging_dir, init_kwargs) for spec in self.log_with]
        for tracker in trackers:
            tracker.start()
        if config is not None:
            for tracker in trackers:
                tracker.store_init_configuration(config)
        self.trackers = trackers
        self._implicit_notebook = None

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The started tracker called ``name`` (its library object with ``unwrap=True``).

        Before ``init_trackers`` (or with no trackers) this is a blank tracker whose methods do
        nothing, as in Accelerate; inside a launch, the notebook tracker once ``log`` has started it.

        Raises:
            ConfigError: trackers are started but none is called ``name``.

        Example:
            >>> writer = accelerator.get_tracker("tensorboard", unwrap=True)   # doctest: +SKIP
        """
        trackers = self.trackers or ([self._implicit_notebook] if self._implicit_notebook is not None else [])
        if not trackers:
            return GeneralTracker(_blank=True)
        for tracker in trackers:
            if tracker.name == name:  # every tracker has a `tracker`: GeneralTracker.__init__ checks it
                return cast(Any, tracker).tracker if unwrap else tracker
        names = [t.name for t in trackers]
        raise ConfigError(f"{name!r} is not one of this Accelerator's trackers {names}. Fix: pass one of those "
                          f"names, or add {name!r} to log_with.", key="name", value=name, valid=names)

    def log(self, values: dict[str, Any], step: int | None = None,
            log_kwargs: dict[str, dict[str, Any]] | None = None) -> None:
        """Log ``values`` (at ``step``) to every tracker, on the main process only.

        Args:
            values: ``{name: number, str or dict of numbers}``; tensors of one element are fine.
            step: the training step (``None``: each tracker's own count).
            log_kwargs: ``{tracker name: keyword arguments for its log}``.

        Raises:
            ConfigError: ``values`` is not a dict.

        Example:
            >>> accelerator.log({"loss": loss.item(), "lr": scheduler.get_last_lr()[0]}, step=step)   # doctest: +SKIP
        """
        if not isinstance(values, Mapping):
            raise ConfigError(f"accelerator.log takes a dict of values (got {values!r}, a {type(values).__name__}). "
                              "Fix: accelerator.log({'loss': loss.item()}, step=step)", key="values", value=values,
                              valid="dict")
        if not is_main_process():
            return
        log_kwargs = log_kwargs or {}
        trackers = self.trackers or self._before_init()
        for tracker in trackers:
            tracker.log(dict(values), step=step, **log_kwargs.get(tracker.name, {}))

    def _before_init(self) -> list[GeneralTracker]:
        """The notebook tracker, started on first use when ``log`` comes before ``init_trackers``."""
        if LoggerType.NOTEBOOK not in self.log_with:
            return []
        if self._implicit_notebook is None:
            self._implicit_notebook = NotebookTracker()
            self._implicit_notebook.start()
        return [self._implicit_notebook]

    def end_training(self) -> None:
        """Finish every tracker (on the main process), then wait for every process.

        Example:
            >>> accelerator.end_training()   # doctest: +SKIP
        """
        for tracker in self.trackers:
            tracker.finish()
        self.wait_for_everyone()
