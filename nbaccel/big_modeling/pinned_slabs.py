"""Host memory a GPU copies from: exact-size buffers, page-locked by registering them, and given back.

A copy engine copies from host to GPU asynchronously, at the bus's speed, only out of
page-locked (pinned) memory. torch's pinned allocator (``pin_memory=True``) rounds every block up
to a power of two (three 1.96 GiB staging buffers lock 8 GiB) and keeps freed blocks locked
until ``torch._C._host_emptyCache()``. Here, as torch's own ``pinned_use_cuda_host_register``
option does, memory is mapped at exactly the size asked, its pages are faulted in by several
threads (the copies into it), and it is then registered (``cudaHostRegister``, one call per
slab: the driver serializes registration under one lock anyway). What always holds:

- A buffer (:func:`host_buffer`) is a private anonymous mapping of exactly the bytes asked (whole
  pages); pinned, it is unregistered before it is unmapped: when :func:`unpin` is called on it
  (its memory then stays valid, pageable), or when its last tensor goes.
- Pinning that fails (the driver's ``cudaHostRegister`` error, a ``RuntimeError``, no CUDA
  runtime) leaves the buffer pageable, with one warning: copies from it are correct, just not
  asynchronous. Nothing fails for want of page-locked memory.
- Offloaded CPU weights are copied once into slabs (:func:`pin_tensors`): each tensor lies
  whole in one slab, at an :data:`ALIGN`-byte offset, placed first fit, largest first
  (:func:`pack`); a slab is :data:`SLAB_BYTES` at most (unless one tensor is bigger) and holds
  exactly what is placed in it. Pinned bytes never exceed ``cap`` (:func:`pinned_cap`: a share of
  what this process may still take, ``MemAvailable`` or its cgroup's headroom); tensors that do
  not fit stay where they are (the streaming pipeline stages them through its ring).
- A pinned copy holds exactly the source's bytes and has its dtype and shape.
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from nbaccel.big_modeling.cpu_copies import (
    CHUNK_BYTES,
    MADV_POPULATE_WRITE,
    copy_threads,
    populate,
)
from nbaccel.host_memory import available_memory

__all__ = ["ALIGN", "SLAB_BYTES", "Placement", "host_buffer", "host_empty_cache", "pack",
           "pin_tensors", "pinned_bytes", "pinned_cap", "unpin"]

SLAB_BYTES = 2**28  # 256 MiB: few registrations for a 100 GB model, small enough to place well
ALIGN = 512  # as the CUDA caching allocator aligns blocks
PINNED_SHARE = 0.5  # of the available memory: leave the rest to the page cache and the process

_log = logging.getLogger(__name__)


class _Region(mmap.mmap):
    """An anonymous mapping, page-locked while registered; unregistered before it is unmapped."""

    address: int = 0
    pinned: bool = False

    def unpin(self) -> int:
        """Unregister the region (its memory stays valid); returns the bytes that were locked."""
        if not self.pinned:
            return 0
        self.pinned = False
        cudart = _cudart()
        if cudart is not None:
            try:
                cudart.cudaHostUnregister(self.address)
            except Exception:  # noqa: BLE001 - the runtime going away at exit: the process frees all
                pass
        return len(self)

    def __del__(self) -> None:
        self.unpin()  # before mmap's own dealloc unmaps the pages


# Every live region by address, to find the one under a tensor; readers make theirs on their threads.
_REGIONS: dict[int, weakref.ref[_Region]] = {}
_REGIONS_LOCK = threading.Lock()


def _live_regions() -> list[_Region]:
    with _REGIONS_LOCK:
        for address in [a for a, ref in _REGIONS.items() if ref() is None]:
            del _REGIONS[address]
        return [r for ref in _REGIONS.values() if (r := ref()) is not None]


def _cudart() -> Any:
    """torch's bindings of the CUDA runtime (``cudaHostRegister``), or ``None`` without CUDA."""
    try:
        return torch.cuda.cudart() if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - a CPU build of torch (AssertionError), or torch at exit
        return None


def _register(region: _Region) -> str | None:
    """Page-lock ``region``; ``None`` when done, else why not."""
    cudart = _cudart()
    if cudart is None:
        return "no CUDA runtime"
    try:
        error = cudart.cudaHostRegister(region.address, len(region), 0)  # cudaHostRegisterDefault
    except RuntimeError as exc:  # what the allocator raises, as for pin_memory=True
        return str(exc)
    if int(error) != 0:
        try:
            return f"cudaHostRegister: {cudart.cudaGetErrorString(error)}"
        except (RuntimeError, TypeError, AttributeError):
            return f"cudaHostRegister: CUDA error {int(error)}"
    region.pinned = True
    return None


def _warn_unpinned(nbytes: int, why: str) -> None:
    warnings.warn(
        f"could not page-lock {nbytes / 2**20:.1f} MiB of host memory ({why}): offloaded weights "
        "are copied to the GPU from pageable memory, correctly but slower than the bus allows. "
        "Fix: lower max_memory['cpu'] (fewer CPU-offloaded bytes to pin), or raise the "
        "locked-memory limit (ulimit -l) of the container.", RuntimeWarning, stacklevel=3)


def _map(nbytes: int) -> tuple[_Region, torch.Tensor]:
    # private, as malloc's: a forked child's writes stay its own, and it is not counted as shmem
    region = _Region(-1, max(1, nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(region, dtype=torch.uint8)[:nbytes]  # the tensor keeps the region
    region.address = tensor.data_ptr()
    with _REGIONS_LOCK:
        _REGIONS[region.address] = weakref.ref(region)
    return region, tensor


def host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """A new uint8 CPU tensor of exactly ``nbytes``, page-locked when ``pin`` and possible.

    Args:
        nbytes: its size.
        pin: page-lock it for asynchronous copies to a GPU (falls back to pageable memory with
            a warning when the driver refuses).

    Returns:
        The tensor; its memory is unmapped (and unregistered first) when its last view goes.

    Example:
        >>> buffer = host_buffer(3 * 2**20 + 5, pin=False)
        >>> buffer.numel(), buffer.is_pinned()
        (3145733, False)
    """
    region, tensor = _map(nbytes)
    if pin:
        why = _register(region)
        if why is not None:
            _warn_unpinned(nbytes, why)
    return tensor


def _regions_of(tensors: Iterable[torch.Tensor | None]) -> list[_Region]:
    found: dict[int, _Region] = {}
    regions = _live_regions()
    for tensor in tensors:
        if tensor is None or tensor.device.type != "cpu" or tensor.numel() == 0:
            continue
        ptr = tensor.data_ptr()
        for region in regions:
            if region.address <= ptr < region.address + len(region):
                found[region.address] = region
    return list(found.values())


def pinned_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes page-locked by :func:`host_buffer` / :func:`pin_tensors` under these tensors.

    Example:
        >>> pinned_bytes([host_buffer(10, pin=False)])
        0
    """
    return sum(len(r) for r in _regions_of(tensors) if r.pinned)


def unpin(tensors: Iterable[torch.Tensor | None]) -> int:
    """Give back the page-locked memory under ``tensors`` (the tensors stay valid, pageable) and
    empty torch's pinned-block cache.

    Only call it once no copy out of them is in flight (synchronize the copy stream first).

    Returns:
        The bytes unlocked.

    Example:
        >>> unpin([host_buffer(10, pin=False), None])
        0
    """
    freed = sum(region.unpin() for region in _regions_of(tensors))
    host_empty_cache()
    return freed


def host_empty_cache() -> None:
    """Return the pinned blocks torch's caching host allocator keeps to the system, where the
    running torch has the call (CUDA builds); otherwise nothing.

    Example:
        >>> host_empty_cache()
    """
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        empty()


@dataclass(frozen=True)
class Placement:
    """Where one tensor lies: slab index and byte offset."""

    slab: int
    offset: int


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def pack(sizes: Sequence[int], cap: int, slab_bytes: int = SLAB_BYTES
         ) -> tuple[list[int], list[Placement | None]]:
    """Place byte sizes into slabs of at most ``slab_bytes``, first fit, largest first, within ``cap``.

    Args:
        sizes: the tensors' sizes in bytes, in any order.
        cap: the most bytes all slabs together may take.
        slab_bytes: the largest slab (a bigger tensor gets a slab of its own size).

    Returns:
        The slab sizes (each exactly what it holds), and for each size its placement (``None``:
        not pinned, over the cap; also for empty tensors).

    Example:
        >>> pack([300, 100, 700], cap=1536, slab_bytes=1024)  # the 100 bytes would go over the cap
        ([1024, 512], [Placement(slab=1, offset=0), None, Placement(slab=0, offset=0)])
    """
    slab = max(slab_bytes, _aligned(max(sizes, default=1)))
    used: list[int] = []
    placements: list[Placement | None] = [None] * len(sizes)
    for k in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        need = _aligned(sizes[k])
        if need == 0 or sum(used) + need > cap:
            continue  # over the cap: a smaller tensor may still fit
        home = next((s for s, u in enumerate(used) if u + need <= slab), len(used))
        if home == len(used):
            used.append(0)
        placements[k] = Placement(home, used[home])
        used[home] += need
    return used, placements


def pinned_cap(share: float = PINNED_SHARE) -> int:
    """``share`` of the memory this process may still take, in bytes: of ``MemAvailable``, or of
    its memory cgroup's headroom where that is less (a container's limit).

    Example:
        >>> pinned_cap() > 0
        True
    """
    return int(available_memory() * share)


def _copy_job(target: torch.Tensor, source: torch.Tensor, first: int, last: int) -> Callable[[], None]:
    def job() -> None:
        # Faulting the fresh pages in is half the cost of pinning: done here, on several threads.
        populate(target.data_ptr() + first, last - first, MADV_POPULATE_WRITE)
        target[first:last].copy_(source[first:last])
    return job


def pin_tensors(tensors: Sequence[torch.Tensor], cap: int, pin: bool = True,
                slab_bytes: int = SLAB_BYTES, threads: int | None = None) -> list[torch.Tensor | None]:
    """Copy contiguous CPU tensors into page-locked slabs; ``None`` for those over ``cap``.

    The copies run on ``threads`` threads in chunks (they fault in the new pages); each slab is
    then registered once. One INFO log line says how many bytes, slabs and seconds it took.

    Args:
        tensors: contiguous CPU tensors.
        cap: the most bytes of slabs to allocate.
        pin: page-lock the slabs (``False``: plain memory, for machines without CUDA).
        slab_bytes: the largest usual slab.
        threads: copying threads (default :func:`~.cpu_copies.copy_threads`).

    Returns:
        For each tensor, a tensor of the same dtype, shape and values in a slab, or ``None``.

    Example:
        >>> [t.tolist() for t in pin_tensors([torch.arange(3.0)], cap=2**20, pin=False)]
        [[0.0, 1.0, 2.0]]
    """
    started = time.perf_counter()
    sizes, placements = pack([t.nbytes for t in tensors], cap, slab_bytes)
    if not sizes:
        return [None] * len(tensors)
    mapped = [_map(size) for size in sizes]
    out: list[torch.Tensor | None] = []
    jobs = []
    for tensor, where in zip(tensors, placements):
        if where is None:
            out.append(None)
            continue
        raw = mapped[where.slab][1][where.offset:where.offset + tensor.nbytes]
        source = tensor.reshape(-1).view(torch.uint8)
        jobs += [_copy_job(raw, source, a, min(a + CHUNK_BYTES, tensor.nbytes))
                 for a in range(0, tensor.nbytes, CHUNK_BYTES)]
        out.append(raw.view(tensor.dtype).view(tensor.shape))
    count = max(1, min(threads or copy_threads(), len(jobs)))
    with ThreadPoolExecutor(count, thread_name_prefix="nbaccel-pin") as pool:
        for future in [pool.submit(job) for job in jobs]:
            future.result()
    refused = [why for region, _ in mapped if pin and (why := _register(region)) is not None]
    if refused:
        _warn_unpinned(sum(len(r) for r, _ in mapped if not r.pinned), refused[0])
    _log.info("pinned %.1f MiB of offloaded weights in %d slab(s) on %d thread(s) in %.2f s (%s)",
              sum(sizes) / 2**20, len(sizes), count, time.perf_counter() - started,
              "page-locked" if pin and not refused else "pageable")
    return out
