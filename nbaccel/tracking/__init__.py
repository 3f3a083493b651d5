"""Experiment tracking with Accelerate's API: TensorBoard, MLflow, W&B, trackio, and the notebook.

``Accelerator(log_with=...)`` picks trackers by name (:class:`LoggerType`) or takes
:class:`GeneralTracker` instances; :mod:`nbaccel.tracking.helpers` holds the Accelerator's
methods; :mod:`nbaccel.tracking.selection` resolves names and checks libraries; each built-in
tracker lives in its own module and imports its library only when started. The notebook side of
the notebook tracker (the history kept while a launch runs) is :mod:`nbaccel.tracking.history`.
"""

from __future__ import annotations

from nbaccel.tracking.base import GeneralTracker, LoggerType, on_main_process

__all__ = ["GeneralTracker", "LoggerType", "on_main_process"]
