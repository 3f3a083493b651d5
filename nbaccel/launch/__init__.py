"""Launching: start N workers, relay their output, bring back results and failures.

One path for every caller (see docs/architecture.md): a :class:`LaunchRequest` built once by
:func:`build_request`, handed by :func:`launch` to the :class:`Launcher` it names.
"""

from nbaccel.launch.base import Launcher
from nbaccel.launch.failures import WorkerFailure
from nbaccel.launch.launcher import debug_launcher, notebook_launcher
from nbaccel.launch.registry import launch, register_launcher
from nbaccel.launch.request import LaunchRequest, build_request

__all__ = ["LaunchRequest", "Launcher", "WorkerFailure", "build_request", "debug_launcher", "launch",
           "notebook_launcher", "register_launcher"]
