"""Runs of this kernel, kept so any cell can show one again: background runs and their handles.

A launch blocks the cell that makes it. A *background* run (``notebook_launcher(...,
background=True)``, ``WorkerPool.run(..., background=True)``, ``%%accel_launch --background``)
returns a :class:`~nbaccel.runs.handle.LaunchRun` at once and is supervised on a thread of its
own, so other cells run meanwhile. This package sits on top of the launch paths, which stay
blocking and unchanged::

    start_run(launch) ─► claim its devices (nbaccel.launch.claims)  ─► LaunchRun, within milliseconds
         thread "nbaccel-run-N": route_output(to the run's record) ─► the blocking launch ─► outcome
    RunRecord (an observer): states, each rank's output (bounded; the rest in a log file), logged
    metrics, displays; replayed to any view that show() attaches later, then kept live

Every run of the kernel, blocking ``%%accel_launch`` cells too, is listed by ``%accel_runs``
(:mod:`nbaccel.magics.runs`) and can be shown again after a browser reload.
"""
