"""Warm ranks: a `WorkerPool` keeps its ranks (and their process group) alive between runs.

A pool is the supervisor's keep-alive policy over any backend's ranks: each run is supervised as a
launch is (:mod:`nbaccel.launch.supervisor`), and only what a run leaves behind outlives it.
"""

from nbaccel.launch.pool.worker_pool import WorkerInfo, WorkerPool

__all__ = ["WorkerInfo", "WorkerPool"]
