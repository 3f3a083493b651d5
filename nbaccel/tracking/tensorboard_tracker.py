"""`TensorBoardTracker`: logs through ``torch.utils.tensorboard`` into ``<logging_dir>/<project_name>``.

Accelerate's tracker of the same name: scalars with ``add_scalar``, strings with ``add_text``,
dicts of scalars with ``add_scalars``; the configuration with ``add_hparams`` and, as in
Accelerate, an ``hparams.yml`` beside the events. Needs the ``tensorboard`` package
(``pip install 'nbaccel[tensorboard]'``).
"""

from __future__ import annotations

import os
import time
from typing import Any

import yaml

from nbaccel.tracking.base import GeneralTracker, on_main_process
from nbaccel.tracking.values import scalar_or_text

__all__ = ["TensorBoardTracker"]


class TensorBoardTracker(GeneralTracker):
    """Writes TensorBoard event files (main process only).

    Args:
        run_name: the project name; events go to ``logging_dir/run_name``.
        logging_dir: the Accelerator's logging directory.
        **kwargs: passed to ``SummaryWriter`` (``flush_secs``, ``comment``, ...).

    Example:
        >>> accelerator = Accelerator(log_with="tensorboard", project_dir="runs")   # doctest: +SKIP
        >>> accelerator.init_trackers("demo"); accelerator.log({"loss": 0.5}, step=1)   # doctest: +SKIP
    """

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.logging_dir = os.path.join(os.fspath(logging_dir), run_name)
        self.init_kwargs = kwargs
        self.writer: Any = None

    @on_main_process
    def start(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(self.logging_dir, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        """The ``SummaryWriter`` (``None`` on other processes)."""
        return self.writer

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Record ``values`` as hyperparameters, and in ``hparams.yml`` under a timestamped folder."""
        self.writer.add_hparams(values, metric_dict={})
        self.writer.flush()
        folder = os.path.join(self.logging_dir, str(time.time()))
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "hparams.yml"), "w") as file:
            yaml.safe_dump(values, file)

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Scalars as scalars, strings as text, dicts of scalars as grouped scalars; flushed."""
        for key, value in values.items():
            if isinstance(value, dict):
                self.writer.add_scalars(key, {k: scalar_or_text(v) for k, v in value.items()}, global_step=step,
                                        **kwargs)
                continue
            value = scalar_or_text(value)
            if isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, global_step=step, **kwargs)
        self.writer.flush()

    @on_main_process
    def finish(self) -> None:
        """Close the writer."""
        if self.writer is not None:
            self.writer.close()
