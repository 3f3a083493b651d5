"""Offloaded CPU weights copied once into a few large pinned slabs, up to a share of free RAM.

A copy engine can only copy from host to GPU asynchronously, at the bus's speed, out of pinned
(page-locked) memory. torch's pinned allocator rounds every block up to a power of two and keeps
it cached, so pinning each tensor on its own can cost up to twice the model. What always holds:

- Slabs are powers of two (:data:`SLAB_BYTES`, or the next power of two above the largest
  tensor when that is bigger); the last one shrinks to the power of two its contents need. Each
  tensor lies whole in one slab, at a :data:`ALIGN`-byte offset, placed first-fit largest first
  (:func:`pack`), so waste is bounded by the last slab and the slabs' tails.
- Pinned bytes never exceed ``cap`` (:func:`pinned_cap`: a share of ``MemAvailable``); tensors
  that do not fit stay where they are (the streaming pipeline stages them through its ring).
- A pinned copy holds exactly the source's bytes and has its dtype and shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["ALIGN", "SLAB_BYTES", "Placement", "pack", "pin_tensors", "pinned_cap"]

SLAB_BYTES = 2**28  # 256 MiB: few enough allocations for a 100 GB model, small enough to waste little
ALIGN = 512  # as the CUDA caching allocator aligns blocks
PINNED_SHARE = 0.5  # of MemAvailable: leave the rest to the page cache and the process


@dataclass(frozen=True)
class Placement:
    """Where one tensor lies: slab index and byte offset."""

    slab: int
    offset: int


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def pack(sizes: Sequence[int], cap: int, slab_bytes: int = SLAB_BYTES
         ) -> tuple[list[int], list[Placement | None]]:
    """Place byte sizes into power-of-two slabs, first fit, largest first, within ``cap``.

    Args:
        sizes: the tensors' sizes in bytes, in any order.
        cap: the most bytes all slabs together may take.
        slab_bytes: the usual slab size (a power of two).

    Returns:
        The slab sizes, and for each size its placement (``None``: not pinned, over the cap;
        also for empty tensors).

    Example:
        >>> pack([300, 100, 700], cap=1536, slab_bytes=1024)  # 100 bytes would need a 1024-byte 2nd slab
        ([1024, 512], [Placement(slab=1, offset=0), None, Placement(slab=0, offset=0)])
    """
    slab = max(slab_bytes, _pow2(max(sizes, default=1)))
    used: list[int] = []
    placements: list[Placement | None] = [None] * len(sizes)
    for k in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        need = _aligned(sizes[k])
        if need == 0:
            continue
        home = next((s for s, u in enumerate(used) if u + need <= slab), len(used))
        trial = used if home < len(used) else [*used, 0]
        if _total(trial, slab, home, need) > cap:
            continue  # over the cap: a smaller tensor may still fit
        used = trial
        placements[k] = Placement(home, used[home])
        used[home] += need
    full = [slab] * (len(used) - 1) + ([_pow2(used[-1])] if used else [])
    return full, placements


def _total(used: list[int], slab: int, home: int, need: int) -> int:
    """Bytes all slabs take once ``need`` more bytes are in slab ``home`` (the last one shrunk)."""
    sizes = [*used]
    sizes[home] += need
    return slab * (len(sizes) - 1) + _pow2(sizes[-1])


def pinned_cap(share: float = PINNED_SHARE) -> int:
    """``share`` of the memory the kernel reports available now (``MemAvailable``), in bytes.

    Example:
        >>> pinned_cap() > 0
        True
    """
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):  # not Linux: assume a modest machine
        available = 8 * 2**30
    return int(available * share)


def pin_tensors(tensors: Sequence[torch.Tensor], cap: int, pin: bool = True,
                slab_bytes: int = SLAB_BYTES) -> list[torch.Tensor | None]:
    """Copy contiguous CPU tensors into pinned slabs; ``None`` for those over ``cap``.

    Args:
        tensors: contiguous CPU tensors.
        cap: the most bytes of slabs to allocate.
        pin: page-lock the slabs (``False``: plain memory, for machines without CUDA).
        slab_bytes: the usual slab size.

    Returns:
        For each tensor, a tensor of the same dtype, shape and values in a slab, or ``None``.

    Example:
        >>> [t.tolist() for t in pin_tensors([torch.arange(3.0)], cap=2**20, pin=False)]
        [[0.0, 1.0, 2.0]]
    """
    sizes, placements = pack([t.nbytes for t in tensors], cap, slab_bytes)
    slabs = [torch.empty(size, dtype=torch.uint8, pin_memory=pin) for size in sizes]
    out: list[torch.Tensor | None] = []
    for tensor, where in zip(tensors, placements):
        if where is None:
            out.append(None)
            continue
        raw = slabs[where.slab][where.offset:where.offset + tensor.nbytes]
        raw.copy_(tensor.reshape(-1).view(torch.uint8))
        out.append(raw.view(tensor.dtype).view(tensor.shape))
    return out
