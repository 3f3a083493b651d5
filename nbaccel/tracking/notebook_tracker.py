"""`NotebookTracker`: sends what ``accelerator.log`` records to the notebook that launched the run.

Inside an nbaccel launch each worker has a control channel to the launching process
(:mod:`nbaccel.launch.worker.channel`); this tracker sends every logged record there as a ``log`` frame,
where the status panel draws it as a live chart and :func:`nbaccel.last_run_history` keeps it.
It is on by default in launched workers (``Accelerator(notebook_tracker=False)`` turns it off)
and does nothing elsewhere. As with every tracker, only the main process logs.

A record is a plain dict: ``{"step": int, "time": float, <name>: <number or str>, ...}``; tensors
and numpy scalars become numbers, ``{"a": {"b": 1}}`` becomes ``{"a/b": 1}``. When ``step`` is
not given, it counts the calls (0, 1, 2, ...), so a chart always has an x axis. The worker keeps
its own copy as :attr:`NotebookTracker.history` (``get_tracker("notebook", unwrap=True)``), which
``-o`` can bring back from a ``%%accel_launch`` cell.
"""

from __future__ import annotations

import time
from typing import Any

from nbaccel.launch.worker.channel import Channel, current_channel
from nbaccel.tracking.base import GeneralTracker, on_main_process
from nbaccel.tracking.values import scalar_or_text

__all__ = ["NotebookTracker", "flatten_values"]


def flatten_values(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``values`` with nested dicts joined by ``/`` and tensors made numbers.

    Example:
        >>> flatten_values({"loss": 1, "acc": {"train": 0.5, "test": 0.25}})
        {'loss': 1, 'acc/train': 0.5, 'acc/test': 0.25}
    """
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_values(value, prefix=f"{name}/"))
        else:
            value = scalar_or_text(value)
            flat[name] = value if isinstance(value, (int, float, str)) else repr(value)
    return flat


class NotebookTracker(GeneralTracker):
    """Streams logged values to the launching notebook (main process only).

    Args:
        run_name: the project name (shown with the chart).
        logging_dir: unused; accepted like the other trackers.

    Attributes:
        history: every record this process sent, in order.
        config: what ``init_trackers(config=...)`` stored.

    Example:
        >>> tracker = NotebookTracker("demo")
        >>> tracker.start(); tracker.log({"loss": 0.5}); tracker.log({"loss": 0.25})
        >>> [(r["step"], r["loss"]) for r in tracker.history]   # kept even with no notebook listening
        [(0, 0.5), (1, 0.25)]
    """

    name = "notebook"
    requires_logging_directory = False

    def __init__(self, run_name: str = "", logging_dir: Any = None) -> None:
        super().__init__()
        self.run_name = run_name
        self.history: list[dict[str, Any]] = []
        self.config: dict[str, Any] = {}
        self._channel: Channel | None = None
        self._next_step = 0

    @on_main_process
    def start(self) -> None:
        self._channel = current_channel()
        if self._channel is not None:
            self._channel.send("log", {"project": self.run_name})

    @property
    def tracker(self) -> list[dict[str, Any]]:
        """The records sent so far (:attr:`history`)."""
        return self.history

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Keep ``values`` and send them with the project name."""
        self.config = dict(values)
        if self._channel is not None:
            self._channel.send("log", {"project": self.run_name, "config": flatten_values(self.config)})

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Send ``values`` at ``step`` (or the next count) to the notebook."""
        step = self._next_step if step is None else int(step)
        self._next_step = step + 1
        record = {"step": step, "time": time.time(), **flatten_values(values)}
        self.history.append(record)
        if self._channel is not None:
            self._channel.post("log", record)  # batched: see nbaccel.launch.worker.channel
