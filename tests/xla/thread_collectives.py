"""torch_xla's collectives among replica threads of one process, carried by Python, for the CPU runtime.

Why: on torch_xla 2.9's CPU runtime (``CPU_NUM_DEVICES=2``), replica threads that compile the same
collective graph at the same time each get their own executable, the runtime keys its collective
rendezvous by the executable's module id, the two threads wait at different rendezvous, and the
process aborts after 10 s (``rendezvous.cc: Termination timeout``). Measured: an ``all_reduce``
works when one thread reaches it seconds after the other (the second finds the graph in the
compile cache; ``CachedCompile`` counts it), and aborts whenever both compile it at once, which
is what training does. Holding a lock around each thread's ``torch_xla.sync()`` did not help (the
op ids still differed). On a TPU the runtime has no such limit.

So on the thread layout the tests replace the transport, not nbaccel: :func:`install` patches
``xm.all_reduce``, ``xm.all_gather``, ``xm.collective_broadcast`` and ``xm.rendezvous`` in the
replica process with versions that exchange CPU copies through a ``threading.Barrier``, with
torch_xla's signatures and in-place rules. Everything nbaccel decides (which collective, when, on
which tensors, from which thread) runs as it does on a TPU, and each call is counted per rank.
``scripts/check_tpu.py`` checks the real transport on a TPU.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from typing import Any

import torch

_lock = threading.Lock()
_installed: dict[int, _Exchange] = {}  # per process id (replica processes are forked)


class _Exchange:
    """Every rank hands in a value; each gets all of them, in rank order."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=60)
        self.slots: list[Any] = [None] * world
        self.calls: Counter[tuple[str, int]] = Counter()

    def all(self, rank: int, value: Any) -> list[Any]:
        self.barrier.wait()
        self.slots[rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before every rank has read
        return out


def _rank() -> int:
    import torch_xla.runtime as xr

    return xr.global_ordinal()


def _reduce(op: str, values: list[torch.Tensor]) -> torch.Tensor:
    stacked = torch.stack(values)
    if op == "sum":
        return stacked.sum(0)
    if op == "mul":
        return stacked.prod(0)
    if op == "max":
        return stacked.amax(0)
    if op == "min":
        return stacked.amin(0)
    raise ValueError(f"thread_collectives: reduce type {op!r} is not carried")


def install() -> Counter[tuple[str, int]]:
    """Carry this replica process's collectives through Python; returns the ``(name, rank)`` call counts.

    Call it first thing in the launched function, in every replica. A no-op with one replica.
    """
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    with _lock:
        exchange = _installed.get(os.getpid())
        if exchange is not None:
            return exchange.calls
        exchange = _installed[os.getpid()] = _Exchange(xr.world_size())

    def all_reduce(reduce_type: str, inputs: Any, scale: float = 1.0, groups: Any = None, pin_layout: bool = True):
        rank = _rank()
        exchange.calls["all_reduce", rank] += 1
        tensors = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
        everyone = exchange.all(rank, [t.detach().cpu() for t in tensors])
        reduced = [_reduce(reduce_type, [e[i] for e in everyone]) * scale for i in range(len(tensors))]
        if isinstance(inputs, torch.Tensor):
            return reduced[0].to(inputs.dtype).to(inputs.device)
        with torch.no_grad():
            for tensor, value in zip(tensors, reduced):
                tensor.copy_(value.to(tensor.dtype).to(tensor.device))
        return inputs

    def all_gather(value: torch.Tensor, dim: int = 0, groups: Any = None, output: Any = None,
                   pin_layout: bool = True) -> torch.Tensor:
        rank = _rank()
        exchange.calls["all_gather", rank] += 1
        everyone = exchange.all(rank, value.detach().cpu())
        return torch.cat(everyone, dim=dim).to(value.device)

    def collective_broadcast(tensors: list[torch.Tensor], root_ordinal: int = 0, groups: Any = None,
                             pin_layout: bool = True) -> None:
        rank = _rank()
        exchange.calls["collective_broadcast", rank] += 1
        everyone = exchange.all(rank, [t.detach().cpu() for t in tensors])
        with torch.no_grad():
            for tensor, value in zip(tensors, everyone[root_ordinal]):
                tensor.copy_(value.to(tensor.device))

    def rendezvous(tag: str, payload: bytes = b"", replicas: Any = ()) -> list[bytes]:
        rank = _rank()
        exchange.calls["rendezvous", rank] += 1
        return exchange.all(rank, payload)

    xm.all_reduce = all_reduce
    xm.all_gather = all_gather
    xm.collective_broadcast = collective_broadcast
    xm.rendezvous = rendezvous
    return exchange.calls
