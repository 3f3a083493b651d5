"""`MLflowTracker`: logs through ``mlflow`` into a local store under the logging directory by default.

Accelerate's tracker of the same name (same arguments, same ``MLFLOW_*`` variables honoured by
mlflow itself), with one difference: when no tracking URI is set (neither ``tracking_uri=`` nor
``MLFLOW_TRACKING_URI``), runs go to a file store at ``<logging_dir>/mlruns`` (``./mlruns``
without one) instead of wherever mlflow's default points, so a notebook's runs stay beside its
other outputs. MLflow 3 keeps its file store only behind ``MLFLOW_ALLOW_FILE_STORE=true``, which
this tracker sets for its own process when it chose that store. Numbers are logged as metrics;
other values are skipped (MLflow metrics are numbers only). Needs ``pip install 'nbaccel[mlflow]'``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from nbaccel.environment import apply_environment
from nbaccel.tracking.base import GeneralTracker, on_main_process
from nbaccel.tracking.values import scalar_or_text

__all__ = ["MLflowTracker"]

# mlflow's tracking URI is process-wide: remember the one set here. A fresh rank keeps it (no rank reset):
# it describes mlflow's own URI, which the rank inherited too; forgetting only this would make that URI the user's.
_chosen_uri: str | None = None


class MLflowTracker(GeneralTracker):
    """Logs to an MLflow run (main process only).

    Args:
        experiment_name: the MLflow experiment (the project name given to ``init_trackers``); ``None``:
            mlflow's active one (``MLFLOW_EXPERIMENT_NAME``, else its ``Default``).
        logging_dir: where the default file store goes (``<logging_dir>/mlruns``).
        run_id: resume this run instead of starting one.
        tags: tags set on the experiment and run.
        nested_run: start the run nested in the active one.
        run_name: the new run's name.
        description: the run's description.
        tracking_uri: where runs are stored; default: mlflow's own setting if any, else the file store.

    Example:
        >>> accelerator = Accelerator(log_with="mlflow", project_dir="runs")   # doctest: +SKIP
        >>> accelerator.init_trackers("demo", config={"lr": 1e-3})             # doctest: +SKIP
    """

    name = "mlflow"
    requires_logging_directory = False

    def __init__(self, experiment_name: str | None = None, logging_dir: str | os.PathLike[str] | None = None,
                 run_id: str | None = None, tags: dict[str, Any] | None = None, nested_run: bool = False,
                 run_name: str | None = None, description: str | None = None,
                 tracking_uri: str | None = None) -> None:
        super().__init__()
        self.experiment_name = experiment_name
        self.logging_dir = logging_dir
        self.run_id = run_id
        self.tags = tags
        self.nested_run = nested_run
        self.run_name = run_name
        self.description = description
        self.tracking_uri = tracking_uri
        self.active_run: Any = None

    def _store_uri(self, mlflow: Any) -> str | None:
        global _chosen_uri
        if self.tracking_uri is not None:
            return self.tracking_uri
        if mlflow.tracking.is_tracking_uri_set() and mlflow.get_tracking_uri() != _chosen_uri:
            return None  # the user's (or MLFLOW_TRACKING_URI's), not one this tracker chose for an earlier run
        if "MLFLOW_ALLOW_FILE_STORE" not in os.environ:  # mlflow's own switch for its file store; the user's wins
            apply_environment({"MLFLOW_ALLOW_FILE_STORE": "true"})
        _chosen_uri = (Path(self.logging_dir or ".") / "mlruns").resolve().as_uri()
        return _chosen_uri

    @on_main_process
    def start(self) -> None:
        import mlflow

        uri = self._store_uri(mlflow)
        if uri is not None:
            mlflow.set_tracking_uri(uri)
            self.tracking_uri = uri
        experiment_id = None  # no name: mlflow's active experiment (MLFLOW_EXPERIMENT_NAME / _ID, else Default)
        if self.experiment_name is not None:
            found = mlflow.search_experiments(filter_string=f"name = '{self.experiment_name}'")
            experiment_id = (found[0].experiment_id if found else
                             mlflow.create_experiment(name=self.experiment_name, tags=self.tags))
        self.active_run = mlflow.start_run(run_id=self.run_id, experiment_id=experiment_id, run_name=self.run_name,
                                           nested=self.nested_run, tags=self.tags, description=self.description)

    @property
    def tracker(self) -> Any:
        """The active ``mlflow.ActiveRun`` (``None`` on other processes)."""
        return self.active_run

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Log ``values`` as run parameters, in batches of MLflow's limit; over-long values are skipped."""
        import mlflow
        from mlflow.utils.validation import (
            MAX_PARAM_VAL_LENGTH,
            MAX_PARAMS_TAGS_PER_BATCH,
        )

        items = [(k, v) for k, v in values.items() if len(str(v)) <= MAX_PARAM_VAL_LENGTH]
        for start in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            mlflow.log_params(dict(items[start:start + MAX_PARAMS_TAGS_PER_BATCH]))

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log the numeric values as metrics at ``step``."""
        import mlflow

        metrics = {k: v for k, v in ((k, scalar_or_text(v)) for k, v in values.items())
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if metrics:
            mlflow.log_metrics(metrics, step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        """End the run."""
        import mlflow

        if self.active_run is not None:
            mlflow.end_run()
