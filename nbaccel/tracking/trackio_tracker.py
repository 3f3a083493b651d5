"""`TrackioTracker`: logs through ``trackio``, a local tracker (a SQLite file per project).

Accelerate's tracker of the same name. trackio keeps its files where ``TRACKIO_DIR`` says (it
reads that variable when it is imported; default ``~/.cache/huggingface/trackio``), not under the
Accelerator's logging directory. Needs ``pip install 'nbaccel[trackio]'``.
"""

from __future__ import annotations

import os
from typing import Any

from nbaccel.tracking.base import GeneralTracker, on_main_process

__all__ = ["TrackioTracker"]


class TrackioTracker(GeneralTracker):
    """Logs to a trackio run (main process only).

    Args:
        run_name: the trackio project.
        logging_dir: unused (trackio picks its own directory); accepted like the other trackers.
        **kwargs: passed to ``trackio.init`` (``name``, ``group``, ...).

    Example:
        >>> accelerator = Accelerator(log_with="trackio")   # doctest: +SKIP
        >>> accelerator.init_trackers("demo"); accelerator.log({"loss": 0.5}, step=1)   # doctest: +SKIP
    """

    name = "trackio"
    requires_logging_directory = False

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str] | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.init_kwargs = kwargs
        self.run: Any = None

    @on_main_process
    def start(self) -> None:
        import trackio

        self.run = trackio.init(project=self.run_name, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        """The ``trackio.Run`` (``None`` on other processes)."""
        return self.run

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Record ``values`` in the run's config."""
        self.run.config.update(values)

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """``run.log(values, step=step)``."""
        self.run.log(values, step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        """Finish the run."""
        if self.run is not None:
            self.run.finish()
