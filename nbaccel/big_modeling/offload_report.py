"""How close to the bus an offloaded model runs: bytes per forward, achieved and measured GB/s,
and where the forward's time went (waiting for copies vs computing).

:func:`offload_report` reads what the streamed offload (:mod:`.streamed_offload`) recorded in
the last complete forward: the ring's copy counts and bytes, and the engine's clock (CUDA timing
events on a GPU, read only here, so forwards never wait for them; host time on CPU, where copies
are synchronous). The bus figure is measured once per process and device, lazily, with a pinned
copy of :data:`BUS_PROBE_BYTES`; on a CPU execution device it is ``None`` ("n/a").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from nbaccel.errors import EnvironmentStateError

__all__ = ["BUS_PROBE_BYTES", "OffloadReport", "host_to_device_bandwidth", "offload_report"]

BUS_PROBE_BYTES = 256 * 2**20  # big enough to reach the bus's steady rate, small enough to pin fast


@dataclass(frozen=True)
class OffloadReport:
    """One offloaded forward against the bus.

    Attributes:
        device: the execution device.
        groups: offloaded groups (blocks) streamed; ``slots``: device buffers they stream through.
        copies: copies into slots in the forward; ``misses``: groups not yet in a slot when
            their compute asked (the compute waited for their whole copy).
        bytes_per_forward: bytes copied host-to-device in the forward.
        forward_s: the forward's span, first offloaded group to last; ``copy_wait_s``: the part of it
            spent waiting for copies (``compute_s`` is the rest).
        bus_bytes_per_s: the measured pinned host-to-device rate of this machine (``None`` on CPU).
    """

    device: str
    groups: int
    slots: int
    copies: int
    misses: int
    bytes_per_forward: int
    forward_s: float
    copy_wait_s: float
    bus_bytes_per_s: float | None

    @property
    def compute_s(self) -> float:
        """The forward's time not spent waiting for copies."""
        return max(0.0, self.forward_s - self.copy_wait_s)

    @property
    def achieved_bytes_per_s(self) -> float:
        """Bytes moved per second of forward."""
        return self.bytes_per_forward / self.forward_s if self.forward_s > 0 else 0.0

    @property
    def bus_limit_s(self) -> float | None:
        """The shortest a forward can take: its bytes over the measured bus (``None`` on CPU)."""
        return None if not self.bus_bytes_per_s else self.bytes_per_forward / self.bus_bytes_per_s

    def __str__(self) -> str:
        limit = self.bus_limit_s
        bus = "n/a (no CUDA device)" if self.bus_bytes_per_s is None else \
            f"{self.bus_bytes_per_s / 1e9:.1f} GB/s measured"
        versus = "" if not limit else f"; {self.forward_s / limit:.2f}x the bus limit ({limit * 1e3:.1f} ms)"
        share = self.copy_wait_s / self.forward_s if self.forward_s > 0 else 0.0
        return (f"offloaded forward on {self.device}: {self.bytes_per_forward / 2**20:.1f} MiB moved "
                f"in {self.copies} copies ({self.groups} groups, {self.slots} slots, {self.misses} "
                f"missed) in {self.forward_s * 1e3:.1f} ms = "
                f"{self.achieved_bytes_per_s / 1e9:.2f} GB/s; bus {bus}{versus}; time: copy wait "
                f"{self.copy_wait_s * 1e3:.1f} ms ({share:.0%}), compute {self.compute_s * 1e3:.1f} ms")

    __repr__ = __str__


@functools.cache
def host_to_device_bandwidth(device: str) -> float | None:
    """Pinned host-to-``device`` bytes per second (best of 3 copies of :data:`BUS_PROBE_BYTES`),
    measured once per process; ``None`` for a device that is not CUDA.

    Example:
        >>> host_to_device_bandwidth("cpu") is None
        True
    """
    if torch.device(device).type != "cuda":
        return None
    host = torch.empty(BUS_PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
    best = float("inf")
    with torch.cuda.device(device):  # the events time the stream the copy runs on
        target = torch.empty_like(host, device=device)
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            target.copy_(host, non_blocking=True)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
    return host.nbytes / best


def _offloads(model: nn.Module) -> list:
    """The distinct streamed offload pipelines of ``model``'s hooks."""
    found = {}
    for module in model.modules():
        hook = getattr(module, "_hf_hook", None)
        for part in getattr(hook, "hooks", (hook,)):
            streamed = getattr(part, "streamed", None)
            if streamed is not None:
                found[id(streamed.offload)] = streamed.offload
    return list(found.values())


def offload_report(model: nn.Module) -> OffloadReport:
    """What the last offloaded forward of ``model`` moved, how fast, and where its time went.

    Returns:
        An :class:`OffloadReport` (its ``str`` is one plain-text line).

    Raises:
        EnvironmentStateError: the model streams no offloaded weights, or has not run a forward
            since they started streaming.

    Example:
        >>> from nbaccel.big_modeling import cpu_offload
        >>> from nbaccel.big_modeling.offload_groups import stream_model
        >>> model = cpu_offload(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), "cpu")
        >>> _ = stream_model(model, torch.device("cpu"))
        >>> with torch.no_grad():
        ...     _ = model(torch.ones(1, 64))
        >>> report = offload_report(model)
        >>> report.bytes_per_forward, report.misses, report.bus_bytes_per_s
        (33280, 1, None)
    """
    offloads = _offloads(model)
    if not offloads:
        raise EnvironmentStateError(
            f"{type(model).__name__} streams no offloaded weights, so there is nothing to report. "
            "Offloaded weights stream when dispatch_model / load_checkpoint_and_dispatch run them "
            "on a GPU. Fix: dispatch with an offloading device map onto a CUDA device.")
    offload = offloads[0]
    ring, engine = offload.ring, offload.engine
    idle = not any(ring.busy)
    stats, clock = (ring.current, engine.clock) if idle else (ring.previous, offload.last_clock)
    times = None if stats is None or clock is None else clock.seconds()
    if times is None or stats.acquired == 0:
        raise EnvironmentStateError(
            f"{type(model).__name__} has not run an offloaded forward since its weights started "
            "streaming (or it ran with gradients enabled, which loads them the plain way). "
            "Fix: run one forward under torch.no_grad(), then ask again.")
    return OffloadReport(str(engine.device), ring.groups, ring.slots, stats.copies, stats.misses,
                         stats.bytes, times[0], min(times[1], times[0]),
                         host_to_device_bandwidth(str(engine.device)))
