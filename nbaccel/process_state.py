"""`ProcessState`: who this process is in the job (rank, world, device, backend), read once.

The state comes from the environment a launcher set (torchrun's variables plus nbaccel's, see
:mod:`nbaccel.environment`), so code in a worker needs no arguments. The process group is set up
on demand and torn down cleanly (live DDP modules are collected first: destroying a gloo group
under them can deadlock).

A process keeps one shared state (as Accelerate's ``PartialState`` does) so that every
``Accelerator`` in it agrees; launched workers drop whatever state they inherited through fork
(a launcher's rank lifecycle starts a new rank generation, :func:`nbaccel.identity.start_afresh`, and
the state of an older generation is dropped when next read), so an ``Accelerator`` made in the
notebook never leaks into them. Device and backend choices, and joining the group, are
:mod:`nbaccel.process_group`'s rules, which a warm rank's join shares. Accelerate's names for this state
(``PartialState``, ``AcceleratorState``) build on it in :mod:`nbaccel.partial_state`, and
:mod:`nbaccel.state` gathers them at Accelerate's import path.
"""

from __future__ import annotations

import gc
import threading
from datetime import timedelta
from typing import Any

import torch

from nbaccel.distributed_type import DistributedType
from nbaccel.environment import MixedPrecision, read_worker_settings
from nbaccel.errors import ConfigError
from nbaccel.identity import WorkerIdentity, current_identity, rank_generation
from nbaccel.process_group import CUDA_WITH_CPU_BACKEND, choose_backend, choose_device, join_process_group

__all__ = ["CUDA_WITH_CPU_BACKEND", "ProcessState", "is_initialized", "reset_process_state", "shared_state",
           "wait_for_everyone"]

def _fsdp_needs_cpu_collectives(settings: Any) -> bool:
    """Accelerate's rule: an FSDP launch that offloads parameters or gathers full state dicts reduces CPU tensors."""
    if settings.distributed_type != "FSDP":
        return False
    config = settings.fsdp_config
    offload = str(config.get("fsdp_offload_params", False)).lower() in ("true", "1")
    return offload or config.get("fsdp_state_dict_type", "FULL_STATE_DICT") == "FULL_STATE_DICT"


_lock = threading.Lock()
_shared: dict[str, Any] = {}
# XLA replicas that run as threads of one process (TPU v2/v3, the CPU runtime) each get their own state.
_per_replica: dict[int, dict[str, Any]] = {}
_generation = rank_generation()  # the rank generation the kept state belongs to


def _state_dict(identity: WorkerIdentity | None) -> dict[str, Any]:
    global _generation
    if _generation != rank_generation():  # this process started afresh as a rank: what an older one left goes
        with _lock:  # once: XLA replica threads may all ask first, and none may clear what another just made
            if _generation != rank_generation():
                reset_process_state()
                _generation = rank_generation()
    if identity is None or not identity.shares_process:
        return _shared
    with _lock:
        return _per_replica.setdefault(identity.rank, {})


class ProcessState:
    """This process's place in the job.

    All instances in one process share their state; the first one made decides ``cpu`` (a later
    ``cpu=True`` while the state is on an accelerator is a :class:`~nbaccel.errors.ConfigError`). XLA
    replicas that run as threads of one process each have their own (rank and world size from
    their :class:`~nbaccel.identity.WorkerIdentity`, not from the shared environment).

    Args:
        cpu: run on CPU even where accelerators exist.
        backend: the ``torch.distributed`` backend; default ``nccl`` on CUDA (``cuda:nccl,cpu:gloo``
            when the job needs CPU collectives too), ``gloo`` on CPU.
        timeout: collective timeout for the process group.
        cpu_collectives: the job all-reduces CPU tensors on CUDA machines (FSDP2 with CPU offload:
            ``clip_grad_norm_`` reduces CPU DTensors); also implied by a launch's FSDP settings, as in
            Accelerate.

    Raises:
        ConfigError: ``cpu=True`` after this process's state was set up on another device.

    Example:
        >>> state = ProcessState()
        >>> state.process_index, state.num_processes
        (0, 1)
    """

    debug: bool = False  # Accelerate's PartialState().debug; set from the launch, settable at run time

    def __init__(self, cpu: bool = False, backend: str | None = None,
                 timeout: timedelta | None = None, cpu_collectives: bool = False) -> None:
        identity = current_identity()  # the one answer to "which rank am I" (nbaccel.identity)
        self.__dict__ = _state_dict(identity)
        if self.__dict__.get("_initialized"):
            if cpu and self.device.type != "cpu":
                raise ConfigError(
                    f"cpu=True was passed, but this process's state was already set up on {self.device} (by an "
                    "earlier Accelerator or ProcessState) and a running process cannot change its device; cpu=True "
                    "counts only in the first one made. Fix: restart the kernel and pass cpu=True to the first "
                    "Accelerator, or run the training through notebook_launcher(..., use_cpu=True)",
                    key="cpu", value=cpu, valid=f"False (the state is on {self.device})")
            return
        with _lock:
            settings = read_worker_settings()
            dist = identity
            self.settings = settings
            self.debug = settings.debug  # shape checks in collectives (NBACCEL_DEBUG / ACCELERATE_DEBUG_MODE)
            self.use_cpu = bool(cpu or settings.use_cpu)
            self.process_index = dist.rank if dist else 0
            self.local_process_index = dist.local_rank if dist else 0
            self.num_processes = dist.world_size if dist else 1
            self.local_num_processes = dist.local_world_size if dist else 1
            self.node_rank = dist.node_rank if dist else 0
            self.mixed_precision: MixedPrecision = settings.mixed_precision
            self.device: torch.device = self._pick_device(settings.distributed_type)
            self.backend = backend or self._pick_backend(cpu_collectives or _fsdp_needs_cpu_collectives(settings))
            self.distributed_type: DistributedType = self._pick_type(settings.distributed_type)
            self._timeout = timeout
            self._initialized = True
            if self.num_processes > 1 and self.backend != "xla":
                self.init_process_group()

    # ------------------------------------------------------------------ choices
    def _pick_device(self, requested: str) -> torch.device:
        return choose_device(self.use_cpu, requested, self.local_process_index)

    def _pick_backend(self, cpu_collectives: bool = False) -> str:
        return choose_backend(self.device, cpu_collectives)

    def _pick_type(self, requested: str) -> DistributedType:
        if self.device.type == "xla":
            return DistributedType.XLA
        if self.num_processes == 1:
            return DistributedType.NO
        if requested in ("FSDP", "DEEPSPEED"):
            return DistributedType(requested)
        return DistributedType.MULTI_GPU if self.device.type == "cuda" else DistributedType.MULTI_CPU

    # ------------------------------------------------------------------ flags
    @property
    def is_main_process(self) -> bool:
        """``True`` on the process with global rank 0."""
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        """``True`` on the process with local rank 0 on its machine."""
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        """``True`` on the process with the highest global rank."""
        return self.process_index == self.num_processes - 1

    @property
    def use_distributed(self) -> bool:
        """Whether more than one process takes part."""
        return self.num_processes > 1

    # ------------------------------------------------------------------ process group
    def init_process_group(self) -> None:
        """Join the process group from the environment (``env://``); only make this rank's GPU current if joined
        already (:func:`nbaccel.process_group.join_process_group`)."""
        join_process_group(self.device, self.backend, self.process_index, self.num_processes, self._timeout)

    def destroy_process_group(self) -> None:
        """Leave the process group, collecting dead DDP modules first (avoids a gloo teardown hang)."""
        import torch.distributed as dist

        gc.collect()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    def wait_for_everyone(self) -> None:
        """Block until every process reaches this point."""
        if self.num_processes > 1:
            if self.device.type == "xla":
                import torch_xla.core.xla_model as xm

                xm.rendezvous("nbaccel.wait_for_everyone")
            else:
                import torch.distributed as dist

                dist.barrier()

    @classmethod
    def _reset_state(cls) -> None:
        """Forget this process's shared state, as Accelerate's ``PartialState._reset_state()`` does.

        Test suites and libraries call it between cases; the next state made reads the environment
        again. A joined process group stays joined (as in Accelerate).
        """
        reset_process_state()

    def __repr__(self) -> str:
        return (f"ProcessState(distributed_type={self.distributed_type!r}, process_index={self.process_index}, "
                f"num_processes={self.num_processes}, device={self.device}, backend={self.backend!r}, "
                f"mixed_precision={self.mixed_precision!r})")


def shared_state() -> dict[str, Any]:
    """The dict every state object of this process (or XLA replica thread) shares as its ``__dict__``.

    Example:
        >>> shared_state() is ProcessState().__dict__
        True
    """
    return _state_dict(current_identity())


def reset_process_state() -> None:
    """Forget the shared state (called in a fresh worker, which must read its own environment)."""
    _shared.clear()
    _per_replica.clear()


def is_initialized() -> bool:
    """Whether this process's state has been set up (by an ``Accelerator`` or a state object), as in Accelerate.

    Example:
        >>> reset_process_state(); is_initialized()
        False
    """
    return bool(_state_dict(current_identity()).get("_initialized"))


def wait_for_everyone() -> None:
    """Accelerate's ``wait_for_everyone()``: block until every process of the job reaches this point."""
    ProcessState().wait_for_everyone()
