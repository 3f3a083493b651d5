"""Which rank am I: the one answer every part of nbaccel asks (a worker's or replica thread's identity).

A launcher's worker body resolves the identity once, when the worker (a process) or replica (a
thread of torch_xla's host, several of which may share one process) starts, and sets it here;
:class:`~nbaccel.process_state.ProcessState`, the cell program of ``%%accel_launch``, the collectives in
:mod:`nbaccel.ops` and the DeepSpeed path all read it back with :func:`current_identity`.
Outside an nbaccel launch (a script under ``torchrun`` or ``accelerate launch``) the identity is
read from torchrun's variables, through :mod:`nbaccel.environment`, the module that owns them.

The identity set for a thread wins over the one set for the process, so replica threads that
share a process each see their own rank. Nothing here imports torch or a launcher.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from nbaccel.environment import DistributedEnv, read_distributed_env

__all__ = ["WorkerIdentity", "clear_identity", "current_identity", "rank_generation", "set_identity", "start_afresh"]


@dataclass(frozen=True)
class WorkerIdentity:
    """Who one worker (or XLA replica thread) is in the job.

    Attributes:
        rank: global rank.
        local_rank: rank on this machine.
        world_size: workers in the job.
        local_world_size: workers on this machine.
        node_rank: this machine's index.
        shares_process: other workers run as threads of this same process (XLA replicas on
            TPU v2/v3 or torch_xla's CPU runtime), so the process environment is not this worker's.

    Example:
        >>> WorkerIdentity(rank=1, local_rank=1, world_size=2).is_main
        False
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    shares_process: bool = False

    @property
    def is_main(self) -> bool:
        """``True`` for global rank 0."""
        return self.rank == 0

    @classmethod
    def from_distributed_env(cls, env: DistributedEnv) -> WorkerIdentity:
        """The identity torchrun's variables describe."""
        return cls(rank=env.rank, local_rank=env.local_rank, world_size=env.world_size,
                   local_world_size=env.local_world_size, node_rank=env.node_rank)


_process: WorkerIdentity | None = None
_thread = threading.local()
_generation = 0


def set_identity(identity: WorkerIdentity | None, *, thread: bool = False) -> None:
    """Record who the calling worker is (``thread=True``: only for the calling thread).

    Called by the worker body of a launcher, once per worker process or replica thread;
    ``None`` forgets it.
    """
    global _process
    if thread:
        _thread.identity = identity
    else:
        _process = identity


def clear_identity() -> None:
    """Forget every identity set in this process (a fresh worker must not keep its parent's)."""
    global _process
    _process = None
    _thread.__dict__.clear()


def start_afresh() -> None:
    """This process becomes a rank that must not see what ran in it before: it is nobody until its launcher says.

    Forgets every identity and begins a new rank generation; state kept per process (the process state
    of :mod:`nbaccel.process_state`) belongs to the generation it was made in and is dropped when next
    read in a newer one. A launcher calls it through its rank lifecycle
    (:class:`nbaccel.rank_lifecycle.RankLifecycle`) in a fresh worker and before each warm-rank task.

    Example:
        >>> before = rank_generation(); start_afresh(); rank_generation() - before
        1
    """
    global _generation
    clear_identity()
    _generation += 1


def rank_generation() -> int:
    """How many times this process has started afresh as a rank (0 in a process no launcher reused)."""
    return _generation


def current_identity() -> WorkerIdentity | None:
    """The calling thread's identity: its replica's, else its process's, else torchrun's variables.

    Returns ``None`` outside any distributed job (a notebook, a plain script).

    Example:
        >>> current_identity() is None or current_identity().world_size >= 1
        True
    """
    identity = getattr(_thread, "identity", None) or _process
    if identity is not None:
        return identity
    env = read_distributed_env()
    return WorkerIdentity.from_distributed_env(env) if env is not None else None
