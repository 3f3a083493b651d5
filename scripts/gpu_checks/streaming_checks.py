"""Checks of the streamed offload (pinned slabs, copy stream, slot ring) on one GPU, run by
``scripts/check_gpu_loading.py``; ``--cpu`` runs the same logic on CPU (copies synchronous,
attached by hand, since dispatch streams only on CUDA), so it can be tried without a GPU.

Each check prints ``ok   <what> <detail>`` or raises ``SystemExit("FAILED: ...")``:

1. pinned slabs: every CPU-offloaded weight lives in a pinned power-of-two slab, few of them;
2. bit-identical outputs over three forwards (the ring wraps around), against the model held
   whole on the GPU and against the plain offload path, for CPU offload, disk offload, and CPU
   offload over a tiny pinned cap (the rest staged through the ring);
3. prefetch order and wrap-around: the second forward copies each group exactly once, in
   order, starting past the groups the first forward already prefetched;
4. no host synchronization in a CPU-offloaded forward (``torch.cuda.set_sync_debug_mode``);
5. memory: the forward allocates nothing large on the GPU beyond the slots made at dispatch,
   and pinned bytes stay under the cap;
6. timing (printed, and streamed must beat the plain path).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

__all__ = ["check_streaming"]


def _check(name: str, condition: bool, detail: object = "") -> None:
    if not condition:
        raise SystemExit(f"FAILED: {name} {detail}")
    print(f"ok   {name} {detail}", flush=True)


def _offload(model: nn.Module) -> list:
    """The model's streamed offload pipelines (one per dispatched model)."""
    hooks = [m._hf_hook for m in model.modules() if getattr(m, "_hf_hook", None) is not None]
    return list({id(h.streamed.offload): h.streamed.offload for h in hooks
                 if getattr(h, "streamed", None) is not None}.values())


def _plain(model: nn.Module) -> list:
    """Turn streaming off (the plain path, as before); returns what to give back."""
    taken = []
    for m in model.modules():
        hook = getattr(m, "_hf_hook", None)
        if getattr(hook, "streamed", None) is not None:
            taken.append((hook, hook.streamed))
            hook.streamed = None
    return taken


def _dispatch(make: Callable[[], nn.Module], folder: Path, device_map: dict, device: torch.device,
              cap: int | None = None) -> nn.Module:
    from nbaccel.big_modeling import (
        cpu_offload,
        init_empty_weights,
        load_checkpoint_and_dispatch,
        streamed_offload,
    )

    original = streamed_offload.pinned_cap
    if cap is not None:
        streamed_offload.pinned_cap = lambda share=0.5: cap  # dispatch reads it at attach time
    try:
        with init_empty_weights():
            model = make().eval()
        on_cpu = device.type == "cpu" and "cpu" in device_map.values()
        model = load_checkpoint_and_dispatch(model, folder, {"": "cpu"} if on_cpu else device_map,
                                             show_progress=False)
        if on_cpu:  # a CPU main device offloads only to disk: offload the CPU weights by hand
            model = cpu_offload(model, "cpu")
        if device.type == "cpu":  # dispatch streams only on CUDA: attach by hand
            from nbaccel.big_modeling.offload_groups import stream_model

            stream_model(model, device, cap=cap if cap is not None else 2**40)
    finally:
        streamed_offload.pinned_cap = original
    return model


def _forwards(model: nn.Module, x: torch.Tensor, times: int = 3) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(x).cpu() for _ in range(times)]


def _record(offload) -> list[tuple]:  # noqa: ANN001 - a StreamedOffload
    calls: list[tuple] = []
    engine = offload.engine
    copy_in = engine.copy_in

    def recording(slot: int, group: int) -> None:
        calls.append((slot, group))
        copy_in(slot, group)

    offload.ring.engine = type("Recording", (), {"copy_in": staticmethod(recording),
                                                 "use": engine.use, "free": engine.free})()
    return calls


def _order_and_wrap(model: nn.Module, x: torch.Tensor) -> None:
    (offload,) = _offload(model)
    n, slots = offload.ring.groups, offload.ring.slots
    _forwards(model, x, 1)
    warm = sorted(g for g in offload.ring.holds if g is not None)
    _check("wrap-around: after a forward the next one's first groups are in the slots",
           warm == sorted({*range(min(slots - 1, n)), n - 1}), f"(slots hold {warm})")
    calls = _record(offload)
    _forwards(model, x, 1)
    groups = [g for _, g in calls]
    expected = [(g + slots - 1) % n for g in range(n)] if n > slots else []
    _check("prefetch order: each group copied once per forward, in order", groups == expected,
           f"({len(groups)} copies over {n} groups, {slots} slots)")


def _no_sync(model: nn.Module, x: torch.Tensor) -> None:
    if x.device.type != "cuda":
        return
    _forwards(model, x, 1)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            model(x)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
    _check("a CPU-offloaded forward never synchronizes the host", not syncs, f"({syncs[:2]})")


def _pinned(model: nn.Module, cap: int | None) -> None:
    (offload,) = _offload(model)
    members = [m for g in offload.engine.groups for m in g if m.nbytes]
    direct = [m.direct for m in members if m.direct is not None]
    slabs = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in direct}
    if cap is None:
        _check("every CPU-offloaded weight is in a slab", len(direct) == len(members))
    else:
        _check("weights over the pinned cap are staged", 0 < len(direct) < len(members),
               f"({len(direct)} of {len(members)} pinned)")
        _check("pinned slabs stay under the cap", sum(slabs.values()) <= cap,
               f"({sum(slabs.values())} <= {cap} bytes)")
    if direct and direct[0].device.type == "cpu" and torch.cuda.is_available():
        _check("slabs are pinned", all(t.is_pinned() for t in direct),
               f"({len(slabs)} slab(s) for {len(direct)} tensors, "
               f"{sum(slabs.values()) / 2**20:.0f} MiB)")


def _memory(model: nn.Module, x: torch.Tensor) -> None:
    if x.device.type != "cuda":
        return
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _forwards(model, x, 1)
    extra = torch.cuda.max_memory_allocated() - base
    _check("a streamed forward allocates no weights on the GPU (they live in the slots)",
           extra < 16 * 2**20, f"({extra / 2**20:.1f} MiB above the dispatched model)")


def _timed(model: nn.Module, x: torch.Tensor) -> float:
    best = float("inf")
    for _ in range(3):
        if x.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        _forwards(model, x, 1)
        best = min(best, time.perf_counter() - start)
    return best


def check_streaming(make: Callable[[], nn.Module], full: nn.Module, folder: Path,
                    maps: dict[str, dict], x: torch.Tensor, device: torch.device,
                    big: torch.Tensor | None = None) -> None:
    """Run the checks above for ``maps`` (``{"cpu": map, "disk": map}``) on ``device``.

    Args:
        make: builds the model (under ``init_empty_weights``).
        full: the same model with its weights, on CPU.
        folder: its checkpoint.
        maps: device maps that offload to CPU and to disk.
        x: an input, on ``device``.
        device: ``cuda:0``, or ``cpu`` for a dry run.
        big: a batch large enough that a layer's compute outlasts the next one's copy.
    """
    with torch.no_grad():
        reference = full.to(device)(x).cpu()
        big_reference = None if big is None else full(big).cpu()
        full.to("cpu")
    tiny = 8 * 2**20
    for label, device_map, cap in (("cpu offload", maps["cpu"], None),
                                   ("disk offload", maps["disk"], None),
                                   ("cpu offload over a tiny pinned cap", maps["cpu"], tiny)):
        model = _dispatch(make, folder, device_map, device, cap)
        outs = _forwards(model, x)
        if big is not None:
            bigs = _forwards(model, big)
            _check(f"{label}: {big.shape[0]}-row batches (compute overlapping copies) bit-identical",
                   all(torch.equal(o, big_reference) for o in bigs),
                   f"(max diff {(bigs[-1] - big_reference).abs().max().item():.3g})")
        if label != "disk offload":
            _pinned(model, cap)
        streamed_time = _timed(model, x)
        given = _plain(model)
        plain = _forwards(model, x, 1)[0]
        plain_time = _timed(model, x)
        for hook, streamed in given:
            hook.streamed = streamed
        _check(f"{label}: three streamed forwards bit-identical to the whole model and the "
               "plain path", all(torch.equal(o, reference) for o in outs) and
               torch.equal(plain, reference),
               f"(max diff {(outs[-1] - reference).abs().max().item():.3g})")
        if label == "cpu offload":
            _order_and_wrap(model, x)
            _no_sync(model, x)
            _memory(model, x)
        faster = streamed_time <= plain_time or device.type == "cpu"
        _check(f"{label}: streamed forward not slower than the plain path", faster,
               f"(streamed {streamed_time * 1e3:.1f} ms, plain {plain_time * 1e3:.1f} ms)")
        del model
