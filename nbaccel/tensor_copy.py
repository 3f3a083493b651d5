"""`copy_tensor_to_devices`: a tensor that exists on one process only, copied to every process.

Unlike :func:`~nbaccel.ops.broadcast`, the other processes need not know its shape or dtype: they
pass ``None``. The holder's shape and dtype travel first (one small object gather), then the
tensor itself as a sum over zeros (as Accelerate does it).
"""

from __future__ import annotations

import torch

from nbaccel.errors import DistributedOperationError
from nbaccel.ops import gather_object, reduce

__all__ = ["copy_tensor_to_devices"]


def copy_tensor_to_devices(tensor: torch.Tensor | None = None) -> torch.Tensor:
    """``tensor`` from the one process that holds it, on every process's device.

    Args:
        tensor: the tensor on exactly one process; ``None`` on every other.

    Returns:
        A copy of the holder's tensor on this process's device.

    Raises:
        DistributedOperationError: no process, or more than one, passed a tensor.

    Example:
        >>> copy_tensor_to_devices(torch.tensor([1, 2]))   # one process: a copy
        tensor([1, 2])
    """
    from nbaccel.process_state import ProcessState

    state = ProcessState()
    described = (tuple(tensor.shape), tensor.dtype) if tensor is not None else None
    everyone = gather_object([described]) if state.num_processes > 1 else [described]
    holders = {rank: d for rank, d in enumerate(everyone) if d is not None}
    if len(holders) != 1:
        raise DistributedOperationError(
            f"copy_tensor_to_devices: exactly one process must pass a tensor and the others None, but "
            f"{len(holders)} did (ranks {sorted(holders)}). Fix: pass the tensor on one process only, e.g. "
            "`copy_tensor_to_devices(t if accelerator.is_main_process else None)`.",
            operation="copy_tensor_to_devices", shapes={r: d[0] if d else None for r, d in enumerate(everyone)})
    shape, dtype = next(iter(holders.values()))
    if tensor is None:
        tensor = torch.zeros(shape, dtype=dtype, device=state.device)
    return reduce(tensor.to(state.device), reduction="sum")
