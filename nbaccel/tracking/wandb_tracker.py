"""`WandBTracker`: logs through ``wandb``, offline by default, into the logging directory.

Accelerate's tracker of the same name, with two differences made for notebooks: the run is
``mode="offline"`` unless ``mode=`` (or wandb's own ``WANDB_MODE``) says otherwise, so nothing
needs an account or the network (``wandb sync`` uploads it later); and its files go under the
Accelerator's logging directory (``dir=``) when there is one. Needs ``pip install 'nbaccel[wandb]'``.
"""

from __future__ import annotations

import os
from typing import Any

from nbaccel.tracking.base import GeneralTracker, on_main_process

__all__ = ["WandBTracker"]


class WandBTracker(GeneralTracker):
    """Logs to a Weights & Biases run (main process only).

    Args:
        run_name: the W&B project.
        logging_dir: where the run's files go (``dir=``), unless ``dir`` is given.
        **kwargs: passed to ``wandb.init`` (``mode``, ``name``, ``tags``, ...).

    Example:
        >>> accelerator = Accelerator(log_with="wandb", project_dir="runs")   # doctest: +SKIP
        >>> accelerator.init_trackers("demo")   # runs/wandb/offline-run-...   # doctest: +SKIP
    """

    name = "wandb"
    requires_logging_directory = False

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str] | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.init_kwargs = dict(kwargs)
        if logging_dir is not None:
            self.init_kwargs.setdefault("dir", os.fspath(logging_dir))
        if "WANDB_MODE" not in os.environ:  # wandb's own variable wins, as it does in wandb
            self.init_kwargs.setdefault("mode", "offline")
        self.run: Any = None

    @on_main_process
    def start(self) -> None:
        import wandb

        if "dir" in self.init_kwargs:
            os.makedirs(self.init_kwargs["dir"], exist_ok=True)
        self.run = wandb.init(project=self.run_name, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        """The ``wandb.Run`` (``None`` on other processes)."""
        return self.run

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Record ``values`` in the run's config."""
        self.run.config.update(values, allow_val_change=True)

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """``run.log(values, step=step)``."""
        self.run.log(values, step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        """Finish the run (writes its offline files)."""
        if self.run is not None:
            self.run.finish()
