"""Which device and ``torch.distributed`` backend a rank uses, and how it joins its process group.

The rules live here once, below both of their users: :class:`~nbaccel.process_state.ProcessState` (an
``Accelerator`` joins on demand) and a warm rank of a pool or a Ray pool, which joins once for the
pool's life through :meth:`nbaccel.rank_lifecycle.RankLifecycle.join_group` and so never reaches
the process state. Nothing here imports a launcher or the process state.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from nbaccel.environment import read_worker_settings
from nbaccel.hardware import cuda_device_count, tpu_detected
from nbaccel.identity import current_identity

if TYPE_CHECKING:
    import torch

__all__ = ["CUDA_WITH_CPU_BACKEND", "choose_backend", "choose_device", "join_process_group", "join_warm_rank_group"]

CUDA_WITH_CPU_BACKEND = "cuda:nccl,cpu:gloo"
"""The backend of a CUDA job that all-reduces CPU tensors too (FSDP2 with CPU offload)."""


def choose_device(use_cpu: bool, distributed_type: str, local_rank: int) -> torch.device:
    """The device of the rank with ``local_rank``: its TPU core, else its GPU (round robin), else the CPU.

    Example:
        >>> choose_device(True, "MULTI_GPU", 3)
        device(type='cpu')
    """
    import torch  # here: the launch layer carries this module, and `%load_ext nbaccel` must not import torch

    if not use_cpu and (distributed_type == "XLA" or (distributed_type == "NO" and tpu_detected())):
        import torch_xla

        return torch_xla.device()
    gpus = 0 if use_cpu else cuda_device_count()  # NVML: an Accelerator() in a notebook keeps fork safe
    if gpus:
        return torch.device("cuda", local_rank % gpus)
    return torch.device("cpu")


def choose_backend(device: torch.device, cpu_collectives: bool = False) -> str:
    """The collective backend for ``device``: xla, gloo on CPU, nccl (with gloo beside it for CPU collectives).

    Example:
        >>> import torch
        >>> choose_backend(torch.device("cuda", 0), cpu_collectives=True)
        'cuda:nccl,cpu:gloo'
    """
    if device.type == "xla":
        return "xla"
    if device.type != "cuda":
        return "gloo"
    # Plain NCCL carries CUDA tensors only; CPU-offloaded FSDP2 reduces CPU DTensors (torch issue 148532).
    return CUDA_WITH_CPU_BACKEND if cpu_collectives else "nccl"


def join_process_group(device: torch.device, backend: str, rank: int, world_size: int,
                       timeout: timedelta | None = None) -> None:
    """Join the group from the environment (``env://``); only make ``device`` current if joined already.

    Whoever made an existing group (user code, a pool, a script's own ``init_process_group``),
    the rank's current CUDA device is set from its local rank: otherwise every rank's stays
    ``cuda:0``, and object collectives and NCCL's own buffers all land on GPU 0.
    """
    import torch
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return
    kwargs: dict[str, Any] = {"backend": backend, "rank": rank, "world_size": world_size}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(**kwargs)


def join_warm_rank_group() -> str:
    """Join the group of a warm rank (once for its pool's life, with CPU collectives); returns its device.

    The choices are the ones a ``ProcessState(cpu_collectives=True)`` made in that rank would make: a
    pool's group outlives any one task, and a later task's FSDP with CPU offload reduces CPU shards.

    Example:
        >>> join_warm_rank_group()   # one process, no GPU: nothing to join
        'cpu'
    """
    settings = read_worker_settings()
    identity = current_identity()
    rank, local_rank, world_size = (identity.rank, identity.local_rank, identity.world_size) if identity else (0, 0, 1)
    device = choose_device(settings.use_cpu, settings.distributed_type, local_rank)
    backend = choose_backend(device, cpu_collectives=True)
    if world_size > 1 and backend != "xla":
        join_process_group(device, backend, rank, world_size)
    return str(device)
