"""Launching: start N workers, relay their output, bring back results and failures."""

from nbaccel.launch.failures import WorkerFailure
from nbaccel.launch.launcher import debug_launcher, notebook_launcher

__all__ = ["WorkerFailure", "debug_launcher", "notebook_launcher"]
