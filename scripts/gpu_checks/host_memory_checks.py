"""Checks of the host memory a GPU copies from (``nbaccel.big_modeling.pinned_slabs``) on one GPU,
run by ``scripts/check_gpu_loading.py``; written without a GPU (2026-12-05), never run on one yet.

Each check prints ``ok   <what> <detail>`` or raises ``SystemExit("FAILED: ...")``:

1. a registered buffer is pinned (``is_pinned()``) at exactly the size asked, where
   ``pin_memory=True`` rounds up to a power of two;
2. copies out of it are asynchronous (the host returns before the copy ends) and as fast as out
   of torch's own pinned memory (GB/s printed for both);
3. pinning 1 GiB of weights into slabs (copies on several threads, then ``cudaHostRegister``)
   against ``torch.empty(pin_memory=True)`` + copy: seconds printed;
4. :func:`unpin` gives it back: ``is_pinned()`` turns false and the values stay readable.
"""

from __future__ import annotations

import time

import torch

__all__ = ["check_host_memory"]


def _check(name: str, condition: bool, detail: object = "") -> None:
    if not condition:
        raise SystemExit(f"FAILED: {name} {detail}")
    print(f"ok   {name} {detail}", flush=True)


def _copy_gbps(source: torch.Tensor, target: torch.Tensor) -> tuple[float, float]:
    """(GB/s of a non-blocking host-to-device copy, seconds the host spent issuing it)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    target.copy_(source, non_blocking=True)
    issued = time.perf_counter() - start
    torch.cuda.synchronize()
    return source.nbytes / (time.perf_counter() - start) / 1e9, issued


def check_host_memory() -> None:
    """Run the checks above on ``cuda:0``."""
    from nbaccel.big_modeling.pinned_slabs import host_buffer, pin_tensors, unpin

    nbytes = 3 * 100 * 2**20 + 1
    buffer = host_buffer(nbytes, pin=True)
    _check("a staging buffer is pinned at exactly its size",
           buffer.is_pinned() and buffer.untyped_storage().nbytes() in (nbytes, -(-nbytes // 4096) * 4096),
           f"({buffer.untyped_storage().nbytes()} bytes for {nbytes})")
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    torch_pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    _copy_gbps(buffer, device)  # warm-up
    ours, issued = _copy_gbps(buffer, device)
    theirs, _ = _copy_gbps(torch_pinned, device)
    _check("copies out of registered memory run at the pinned speed, asynchronously",
           ours >= 0.8 * theirs and issued < 0.5 * nbytes / (ours * 1e9),
           f"({ours:.1f} GB/s, torch's pinned {theirs:.1f} GB/s; issued in {issued * 1e3:.2f} ms)")
    weights = [torch.randn(2**26 // 4) for _ in range(16)]  # 16 x 64 MiB
    start = time.perf_counter()
    slabs = pin_tensors(weights, cap=2**31, pin=True)
    ours_s = time.perf_counter() - start
    start = time.perf_counter()
    plain = [torch.empty(w.nbytes, dtype=torch.uint8, pin_memory=True) for w in weights]
    for w, p in zip(weights, plain):
        p.copy_(w.view(torch.uint8))
    theirs_s = time.perf_counter() - start
    _check("1 GiB of weights pinned into slabs", all(s.is_pinned() for s in slabs),
           f"({ours_s:.2f} s; pin_memory=True + copy {theirs_s:.2f} s)")
    freed = unpin(slabs)
    _check("unpin gives the memory back and the weights stay readable",
           freed >= 2**30 and not slabs[0].is_pinned() and torch.equal(slabs[3], weights[3]),
           f"({freed / 2**20:.0f} MiB unlocked)")
