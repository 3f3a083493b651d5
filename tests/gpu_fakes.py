"""A faked CUDA world for CPU machines: tensors that say they live on ``cuda:0``, and recorded collectives.

Nothing here runs a kernel on a GPU. What it checks is the part that breaks first on a real one:
what nbaccel hands each collective (NCCL carries CUDA tensors only) and which backend string
it asks ``init_process_group`` for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

CUDA0 = torch.device("cuda", 0)


class FakeCudaTensor(torch.Tensor):
    """A CPU tensor that reports ``cuda:0`` as its device; operations on it give plain CPU tensors."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def device(self) -> torch.device:  # type: ignore[override]  # a fake device on purpose
        return CUDA0

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]  # a fake device on purpose
        return True

    def cpu(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]  # a plain tensor back
        return self.as_subclass(torch.Tensor).clone()


_real_to = torch.Tensor.to


def _target_device(args: tuple, kwargs: dict) -> torch.device | None:
    candidate = kwargs.get("device", args[0] if args else None)
    if isinstance(candidate, (str, torch.device)):
        return torch.device(candidate)
    return None


def _fake_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    device = _target_device(args, kwargs)
    if device is None:
        return _real_to(self, *args, **kwargs)
    plain = self.as_subclass(torch.Tensor) if isinstance(self, FakeCudaTensor) else self
    if device.type == "cuda":
        if isinstance(self, FakeCudaTensor):
            return self
        rest = {k: v for k, v in kwargs.items() if k not in ("device", "non_blocking", "copy")}
        dtype = rest.pop("dtype", args[1] if len(args) > 1 and isinstance(args[1], torch.dtype) else None)
        return (plain.to(dtype) if dtype is not None else plain).clone().as_subclass(FakeCudaTensor)
    if isinstance(self, FakeCudaTensor):
        return plain.clone()
    return _real_to(self, *args, **kwargs)


@dataclass
class CollectiveLog:
    """What each recorded collective was handed: ``(name, device of the tensor)`` in call order."""

    calls: list[tuple[str, torch.device]] = field(default_factory=list)

    def off_device(self) -> list[tuple[str, torch.device]]:
        """The calls that got a tensor not on ``cuda``."""
        return [(name, device) for name, device in self.calls if device.type != "cuda"]


def fake_cuda_world(monkeypatch: Any, world_size: int = 2, rank: int = 0,
                    group_device_types: frozenset[str] = frozenset({"cuda"})) -> CollectiveLog:
    """Pretend this process is rank ``rank`` of an NCCL job on ``cuda:0``; record every collective.

    The process state reports ``cuda:0``; ``tensor.to("cuda")`` gives a :class:`FakeCudaTensor`;
    the default group carries only ``group_device_types`` (plain NCCL: ``{"cuda"}``); the
    collectives change nothing (rank 0's values are everyone's) and log what they were given.
    """
    from nbaccel import ops, process_state
    from nbaccel.environment import WorkerSettings

    log = CollectiveLog()
    monkeypatch.setattr(torch.Tensor, "to", _fake_to)
    monkeypatch.setattr(process_state, "_shared", {
        "_initialized": True, "settings": WorkerSettings(distributed_type="MULTI_GPU"), "use_cpu": False,
        "process_index": rank, "local_process_index": rank, "num_processes": world_size,
        "local_num_processes": world_size, "node_rank": 0, "mixed_precision": "no", "device": CUDA0,
        "backend": "nccl", "distributed_type": process_state.DistributedType.MULTI_GPU, "_timeout": None})
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world_size)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cuda:nccl")
    monkeypatch.setattr(ops, "group_device_types", lambda: group_device_types)

    def record(name: str, tensor: torch.Tensor) -> None:
        log.calls.append((name, tensor.device))

    monkeypatch.setattr(dist, "broadcast", lambda t, src=0, group=None, async_op=False: record("broadcast", t))
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, group=None, async_op=False: record("all_reduce", t))

    def all_gather_into_tensor(out: torch.Tensor, t: torch.Tensor, group: Any = None, async_op: bool = False) -> None:
        record("all_gather_into_tensor", t)
        out.copy_(t.as_subclass(torch.Tensor).repeat(world_size, *[1] * (t.ndim - 1)))

    monkeypatch.setattr(dist, "all_gather_into_tensor", all_gather_into_tensor)
    monkeypatch.setattr(dist, "broadcast_object_list", lambda objs, src=0, group=None, device=None: None)
    monkeypatch.setattr(dist, "all_gather_object",
                        lambda out, obj, group=None: out.__setitem__(slice(None), [obj] * len(out)))
    return log
