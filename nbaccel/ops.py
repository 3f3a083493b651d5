"""Collectives on nested tensors: gather, pad, reduce, broadcast across processes.

Every function accepts a tensor or any nesting of lists, tuples and dicts of tensors (and
leaves other values alone where that makes sense), like Accelerate's ``accelerate.utils``
operations. Collectives go through ``torch.distributed`` (gloo, nccl), or through
``torch_xla``'s ``xm`` functions when the tensors live on an XLA device. In a single process they
return their input (gathers return it unchanged, reductions a copy).

A tensor on a device the process group cannot carry (a CPU tensor under NCCL, which carries
CUDA tensors only: "No backend type associated with device type cpu") travels through this
process's device and comes back on its own device, so nbaccel's own CPU seeds and RNG states,
and a user's CPU metrics, can be broadcast, reduced and gathered under any backend.
"""

from __future__ import annotations

import pickle
import sys
import warnings
from collections.abc import Mapping
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist

from nbaccel.errors import ConfigError, DistributedOperationError
from nbaccel.identity import current_identity
from nbaccel.nested_data import recursively_apply

__all__ = [
    "CannotPadNestedTensorWarning",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "pad_across_processes",
    "reduce",
]

Reduction = Literal["sum", "mean", "max", "none"]


def _world() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    if "torch_xla" in sys.modules:  # XLA replicas have no torch.distributed group
        identity = current_identity()
        return identity.world_size if identity is not None else 1
    return 1


def group_device_types() -> frozenset[str]:
    """The device types the default process group has a backend for (``{"cuda"}`` under plain NCCL)."""
    group = dist.distributed_c10d._get_default_group()
    return frozenset(d.type for d in getattr(group, "_device_types", ()))


def _carried(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when the default group can carry its device, else a copy on this process's device."""
    types = group_device_types()
    if not types or tensor.device.type in types:
        return tensor
    from nbaccel.process_state import ProcessState

    return tensor.to(ProcessState().device)


def _backend_for(device_type: str) -> str:
    """The default group's backend name for ``device_type`` (``"gloo"``, ``"nccl"``, ...)."""
    config = dist.get_backend_config()
    pairs = dict(item.split(":", 1) for item in config.split(",") if ":" in item)
    return pairs.get(device_type, config)


def _is_xla(tensor: torch.Tensor) -> bool:
    """Whether this collective goes through torch_xla: XLA tensors, or any tensor among XLA replicas."""
    if tensor.device.type == "xla":
        return True
    return not (dist.is_available() and dist.is_initialized()) and _world() > 1


def _on_xla(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on this replica's XLA device (CPU tensors are copied there for the collective)."""
    if tensor.device.type == "xla":
        return tensor
    from nbaccel.process_state import ProcessState

    return tensor.to(ProcessState().device)


def _debug_enabled() -> bool:
    from nbaccel.process_state import ProcessState

    return bool(ProcessState().debug)  # Accelerate's PartialState().debug, settable at run time


def _verify_shapes(operation: str, data: Any) -> None:
    """In debug mode, check that every process passes tensors of the same shapes (one extra gather)."""
    shapes = recursively_apply(lambda t: tuple(t.shape), data)
    everyone: list[Any] = [None] * _world()
    dist.all_gather_object(everyone, shapes)
    if any(s != everyone[0] for s in everyone):
        by_rank = dict(enumerate(everyone))
        raise DistributedOperationError(
            f"{operation}: the processes passed tensors of different shapes {by_rank}; "
            "pad them first with `pad_across_processes(tensor, dim=0)`", operation=operation, shapes=by_rank)


def gather(tensor: Any) -> Any:
    """Gather tensors from every process, concatenated along the first dimension.

    Example:
        >>> gather(torch.arange(2)).tolist()   # one process
        [0, 1]
    """
    if _world() == 1 and not _xla_multi(tensor):
        return tensor
    if _debug_enabled() and not _xla_multi(tensor):
        _verify_shapes("gather", tensor)
    return recursively_apply(_gather_one, tensor, error_on_other_type=True)


def _xla_multi(data: Any) -> bool:
    leaves: list[torch.Tensor] = []
    recursively_apply(leaves.append, data)
    return bool(leaves) and _is_xla(leaves[0])


def _gather_one(tensor: torch.Tensor) -> torch.Tensor:
    if _is_xla(tensor):
        import torch_xla.core.xla_model as xm

        return xm.all_gather(_on_xla(tensor if tensor.ndim else tensor[None]), dim=0).to(tensor.device)
    home = tensor.device
    if tensor.ndim == 0:
        tensor = tensor.clone()[None]
    tensor = _carried(tensor)
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    out = tensor.new_empty((_world() * tensor.shape[0], *tensor.shape[1:]))
    if _backend_for(tensor.device.type) == "gloo":  # gloo has no all_gather_into_tensor
        dist.all_gather(list(out.chunk(_world())), tensor)
    else:
        dist.all_gather_into_tensor(out, tensor)
    return out.to(home)


def gather_object(object: Any) -> Any:  # noqa: A002 - Accelerate's parameter name
    """Gather picklable objects from every process into one flat list, as Accelerate does.

    In one process ``object`` comes back unchanged. With several, each process's ``object`` is
    flattened one level (a list, tuple, tensor rows, any iterable) and the pieces are joined in
    rank order; a string, a mapping or a non-iterable counts as one item.

    Example:
        >>> gather_object(["a"])   # one process: unchanged
        ['a']
    """
    world = _world()
    if world == 1:
        return object
    items = _as_items(object)
    if _xla_device_in_use():
        import torch_xla.core.xla_model as xm

        # Not xm.mesh_reduce: it unpickles with torch.load, which (weights_only, torch >= 2.6) refuses most objects.
        parts = xm.rendezvous("nbaccel.gather_object", pickle.dumps(items))
        return [x for part in parts for x in pickle.loads(part)]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, items)
    return [x for part in everyone for x in part]


def _as_items(obj: Any) -> list[Any]:
    """``obj``'s items for :func:`gather_object` (Accelerate iterates it; strings and dicts stay whole here)."""
    if isinstance(obj, (str, bytes, Mapping)) or (torch.is_tensor(obj) and obj.ndim == 0):
        return [obj]
    try:
        return list(obj)
    except TypeError:
        return [obj]


def _xla_device_in_use() -> bool:
    from nbaccel.process_state import ProcessState

    return ProcessState().device.type == "xla"


class CannotPadNestedTensorWarning(UserWarning):
    """:func:`pad_across_processes` met a nested tensor, which it leaves as it is (no padded shape exists)."""


def pad_across_processes(tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
    """Pad each tensor along ``dim`` to the largest size any process has, so it can be gathered.

    A tensor without dimension ``dim`` is returned as it is; a nested tensor too, with a
    :class:`CannotPadNestedTensorWarning`. Any leaf that is not a tensor is a ``TypeError``, in
    one process as in several (as in Accelerate).

    Raises:
        TypeError: ``tensor`` holds something other than tensors in lists, tuples and dicts.
        DistributedOperationError: in debug mode, the processes' tensors differ in dimensions.

    Example:
        >>> pad_across_processes(torch.ones(2)).tolist()   # one process: unchanged
        [1.0, 1.0]
    """
    alone = _world() == 1 and not _xla_multi(tensor)

    def _pad(t: torch.Tensor) -> torch.Tensor:
        if getattr(t, "is_nested", False):
            warnings.warn("pad_across_processes cannot pad a nested tensor (its rows differ in "
                          "shape); it is left as it is. Fix: pad its rows before nesting them.",
                          CannotPadNestedTensorWarning, stacklevel=4)
            return t
        if alone or dim >= t.ndim or dim < -t.ndim:
            return t
        # the whole shape travels, so debug mode's check in gather sees ranks that disagree on ndim
        shapes = gather(torch.tensor(t.shape, device=t.device)[None])
        biggest = int(shapes[:, dim].max().item())
        if biggest == t.shape[dim]:
            return t
        shape = list(t.shape)
        shape[dim] = biggest
        out = t.new_full(shape, pad_index)
        index = [slice(None)] * t.ndim
        index[dim] = slice(biggest - t.shape[dim], biggest) if pad_first else slice(0, t.shape[dim])
        out[tuple(index)] = t
        return out

    try:
        return recursively_apply(_pad, tensor, error_on_other_type=True)
    except DistributedOperationError as exc:  # raised by gather's check: name the caller's call
        raise DistributedOperationError(
            f"pad_across_processes: {exc}", operation="pad_across_processes", shapes=exc.shapes) from exc


def reduce(tensor: Any, reduction: Reduction = "mean", scale: float = 1.0) -> Any:
    """Reduce tensors across processes; returns new tensors (Accelerate's semantics).

    ``"sum"`` and ``"none"`` add the processes' tensors, ``"mean"`` divides that sum by the
    number of processes, ``"max"`` keeps the element-wise maximum. In one process every
    reduction returns a copy. ``scale`` multiplies the reduced value on XLA devices only, as in
    Accelerate; elsewhere it is ignored (with a warning when it is not 1).

    Args:
        tensor: a tensor or a nesting of lists, tuples and dicts of tensors.
        reduction: how to combine the processes' values.
        scale: factor applied by the XLA all-reduce.

    Raises:
        ConfigError: ``reduction`` is not one of the valid names.

    Example:
        >>> reduce(torch.tensor([2.0]), "max").tolist()   # one process: a copy
        [2.0]
    """
    valid = get_args(Reduction)
    if reduction not in valid:
        raise ConfigError(f"`reduction` must be one of {list(valid)} (got {reduction!r}); "
                          "use 'sum' to add the processes' values", key="reduction", value=reduction, valid=valid)
    if scale != 1.0 and not _xla_multi(tensor):
        warnings.warn(f"reduce(scale={scale}) is applied on XLA devices only, as in Accelerate; here it is "
                      "ignored: multiply the result yourself", stacklevel=2)
    world = _world()
    if world > 1 and _debug_enabled() and not _xla_multi(tensor):
        _verify_shapes("reduce", tensor)

    def _reduce(t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        if _is_xla(t):
            import torch_xla.core.xla_model as xm
            import torch_xla.runtime as xr

            op = xm.REDUCE_MAX if reduction == "max" else xm.REDUCE_SUM
            out = xm.all_reduce(op, _on_xla(out), scale=scale).to(t.device)
            return out / xr.world_size() if reduction == "mean" else out
        if world == 1:
            return out
        moved = _carried(out)
        dist.all_reduce(moved, op=dist.ReduceOp.MAX if reduction == "max" else dist.ReduceOp.SUM)
        out = moved.to(t.device)
        return out / world if reduction == "mean" else out

    return recursively_apply(_reduce, tensor, error_on_other_type=True)


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Send ``from_process``'s tensors to every process (in place where possible; returns them).

    Example:
        >>> broadcast(torch.ones(1)).tolist()
        [1.0]
    """
    def _bcast(t: torch.Tensor) -> torch.Tensor:
        if _is_xla(t):
            import torch_xla.core.xla_model as xm

            moved = _on_xla(t)
            xm.collective_broadcast([moved], root_ordinal=from_process)
            if moved is not t:
                t.copy_(moved.cpu())
            return t
        moved = _carried(t)
        dist.broadcast(moved, src=from_process)
        if moved is not t:
            t.copy_(moved)
        return t

    if _world() == 1 and not _xla_multi(tensor):
        return tensor
    if _debug_enabled() and not _xla_multi(tensor):
        _verify_shapes("broadcast", tensor)
    return recursively_apply(_bcast, tensor, error_on_other_type=True)


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """Replace ``object_list``'s items with ``from_process``'s, in place; returns the list.

    Example:
        >>> broadcast_object_list([1, 2])
        [1, 2]
    """
    if _world() == 1:
        return object_list
    if _xla_device_in_use():
        import torch_xla.core.xla_model as xm

        from nbaccel.process_state import ProcessState

        mine = pickle.dumps(object_list) if ProcessState().process_index == from_process else b"-"
        # Not xm.mesh_reduce: it unpickles with torch.load, which (weights_only, torch >= 2.6) refuses bytes.
        object_list[:] = pickle.loads(xm.rendezvous("nbaccel.broadcast_object_list", mine)[from_process])
        return object_list
    dist.broadcast_object_list(object_list, src=from_process)
    return object_list
