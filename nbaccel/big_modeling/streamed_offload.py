"""Offloaded weights streamed to the execution device while the layer before them computes.

::

    CPU weights ── once, at dispatch ──► pinned slabs ───────────────┐ (copied directly)
    over the cap, or on disk ── reader threads ──► pinned staging ───┤ (one buffer per slot)
                                                                     ▼
                           copy stream: wait(slot free) · copies · record(ready)
                                                                     ▼
                      `slots` device buffers ──► compute stream: wait(ready) · layer · record(free)

:class:`~.slot_ring.SlotRing` decides which group goes into which slot; :class:`SlotEngine`
carries it out. What always holds:

- A layer computes on the exact bytes ``weights_map`` would give (the same dtype, shape and
  values: copies of bytes, casts done as the loader does them), so outputs are bit-identical to
  loading each weight with ``.to(device)``.
- The host never waits for the device: copies and layers are ordered by CUDA events only (the
  host joins a reader thread, which has by then normally long finished).
- Slot buffers and staging buffers are owned by the engine for its whole life (no tensor of
  them is ever freed while in flight; ``record_stream`` marks the slots as used by the copy
  stream for the allocator); a staging buffer is refilled only once the copy out of it is done.
- With gradients enabled, a hook takes its weights the plain way (autograd may keep a weight
  for the backward pass, and a slot is overwritten by a later layer).
- On a CPU execution device the same engine runs with synchronous copies (used by the tests);
  :func:`stream_offloaded` is only attached for CUDA by ``dispatch_model``.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from nbaccel.big_modeling.checkpoint_files import TensorInfo
from nbaccel.big_modeling.cpu_copies import copy_threads
from nbaccel.big_modeling.offload import OffloadedWeightsLoader, PrefixedDataset
from nbaccel.big_modeling.pinned_slabs import ALIGN, host_buffer, pin_tensors, pinned_cap, unpin
from nbaccel.big_modeling.slot_ring import SlotRing
from nbaccel.big_modeling.staging_reads import SplitReads

__all__ = ["OFFLOAD_SLOTS", "Member", "SlotEngine", "StreamedGroup", "StreamedOffload", "stream_offloaded"]

OFFLOAD_SLOTS = 3  # one layer computing, two on their way: hides a copy up to twice a layer's compute
READERS = 4  # threads reading disk (or pageable RAM) into the staging ring


@dataclass
class Member:
    """One tensor of a group: where it goes in the slot, and where its bytes come from."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    offset: int = 0
    direct: torch.Tensor | None = None  # contiguous host tensor copied straight from (pinned on CUDA)
    info: TensorInfo | None = None  # read from this file into staging
    fetch: Callable[[], torch.Tensor] | None = None  # this value is copied into staging


def _layout(members: list[Member]) -> int:
    """Give each member an ``ALIGN``-byte offset in the slot; returns the slot bytes needed."""
    end = 0
    for m in members:
        m.offset = end
        end += -(-m.nbytes // ALIGN) * ALIGN
    return end


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


class SlotEngine:
    """The copy engine of :class:`~.slot_ring.SlotRing`: slots on ``device``, a copy stream,
    a staging ring filled by reader threads.

    Args:
        device: the execution device (CUDA; CPU copies synchronously).
        groups: each group's members, laid out (``offset``) already.
        slots: how many device buffers.
        readers: how many reader threads fill the staging ring.
    """

    def __init__(self, device: torch.device, groups: Sequence[list[Member]], slots: int,
                 readers: int = READERS) -> None:
        self.device, self.groups, self.cuda = device, groups, device.type == "cuda"
        self.slot_bytes = max(max((m.offset + m.nbytes for m in g), default=0) for g in groups)
        self.slot_bytes = max(ALIGN, -(-self.slot_bytes // ALIGN) * ALIGN)
        self.buffers = torch.empty(slots * self.slot_bytes, dtype=torch.uint8, device=device)
        staged = any(m.direct is None and m.nbytes for g in groups for m in g)
        self.staging = host_buffer(slots * self.slot_bytes, pin=self.cuda) if staged else None
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        if self.stream is not None:
            # The allocator may hand out memory that work queued on the current stream still
            # uses (safe on that stream only): the copy stream starts after that work.
            self.stream.wait_stream(torch.cuda.current_stream(device))
            self.buffers.record_stream(self.stream)  # freed only after the copy stream's work
        self.views = [[self._views(s, g) for g in groups] for s in range(slots)]
        self.ready: list[Any] = [None] * slots  # event: the last copy into the slot is done
        self.freed: list[Any] = [None] * slots  # event: the last use of the slot is done
        self.staged: list[Any] = [None] * slots  # event: the last copy out of staging is done
        self.jobs: list[Future | None] = [None] * slots
        self.pool = ThreadPoolExecutor(readers, thread_name_prefix="nbaccel-offload-read") \
            if staged else None
        # every reader on every group's pieces; as many as the copies may use (up to 8) where more
        self.reads = SplitReads(max(readers, copy_threads())) if staged else None

    def _views(self, slot: int, members: list[Member]) -> dict[str, torch.Tensor]:
        base = slot * self.slot_bytes
        return {m.name: (self.buffers[base + m.offset:base + m.offset + m.nbytes]
                         .view(m.dtype).view(m.shape)) if m.nbytes else
                torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in members}

    def _context(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def copy_in(self, slot: int, group: int) -> None:
        """Bring ``group`` into ``slot`` after the slot's last use: directly, or on a reader."""
        self._join(slot)  # a copy into this slot still being issued goes first
        freed = self.freed[slot]
        if any(m.direct is None and m.nbytes for m in self.groups[group]):
            self.jobs[slot] = self.pool.submit(self._staged_copy, slot, group, freed)
        else:
            self.ready[slot] = self._issue(slot, group, freed)

    def use(self, slot: int) -> None:
        """Make the current stream wait for the slot's last copy (no host wait)."""
        self._join(slot)
        if self.cuda and self.ready[slot] is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready[slot])

    def free(self, slot: int) -> None:
        """Record the point on the current stream after which the slot may be overwritten."""
        if self.cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self.freed[slot] = event

    def _join(self, slot: int) -> None:
        job, self.jobs[slot] = self.jobs[slot], None
        if job is not None:
            job.result()  # a reader's error (a file cut short) is raised here, in the caller

    def _issue(self, slot: int, group: int, freed: Any) -> Any:
        """Queue the copies of ``group`` into ``slot`` on the copy stream; returns their event."""
        base = slot * self.slot_bytes
        with self._context():
            if self.stream is not None and freed is not None:
                self.stream.wait_event(freed)
            for m in self.groups[group]:
                if not m.nbytes:
                    continue
                source = m.direct if m.direct is not None else \
                    self.staging[base + m.offset:base + m.offset + m.nbytes]
                target = self.buffers[base + m.offset:base + m.offset + m.nbytes]
                target.copy_(_bytes(source), non_blocking=self.cuda)
            if self.stream is None:
                return None
            event = torch.cuda.Event()
            event.record(self.stream)
            return event

    def _staged_copy(self, slot: int, group: int, freed: Any) -> None:
        """On a reader thread: fill the slot's staging buffer, then queue the copies."""
        if self.staged[slot] is not None:
            self.staged[slot].synchronize()  # the copy out of this staging buffer is done
        base, parts = slot * self.slot_bytes, []
        for m in self.groups[group]:
            if m.direct is not None or not m.nbytes:
                continue
            target = self.staging[base + m.offset:base + m.offset + m.nbytes]
            if m.info is not None:
                parts.append((m.info, memoryview(target.numpy())))
            else:
                target.copy_(_bytes(m.fetch()))
        self.reads.read(parts)
        self.ready[slot] = self.staged[slot] = self._issue(slot, group, freed)

    def close(self) -> None:
        """Stop the reader threads (after the reads in flight) and give back the page-locked
        host memory (the tensors stay valid, pageable); called when the pipeline goes."""
        if self.pool is not None:
            # the collector may run this on one of the readers (a thread cannot join itself)
            joined = not threading.current_thread().name.startswith("nbaccel-offload")
            self.pool.shutdown(wait=joined)
            self.reads.close(wait=joined)
        if self.stream is not None:
            self.stream.synchronize()  # no copy out of host memory outlives its registration
        unpin([self.staging, *(m.direct for g in self.groups for m in g)])


class StreamedOffload:
    """The offloaded groups of one model, streamed through ``slots`` device buffers.

    Args:
        device: the execution device.
        groups: each group's members (laid out here).
        slots: how many device buffers.

    Example:
        >>> m = Member("w", torch.float32, (2,), 8, direct=torch.ones(2))
        >>> offload = StreamedOffload(torch.device("cpu"), [[m]], slots=2)
        >>> with torch.no_grad():
        ...     offload.acquire(0)["w"]
        tensor([1., 1.])
        >>> offload.release(0)
    """

    def __init__(self, device: torch.device, groups: Sequence[list[Member]],
                 slots: int = OFFLOAD_SLOTS) -> None:
        for members in groups:
            _layout(members)
        self.engine = SlotEngine(device, groups, slots)
        self.ring = SlotRing(len(groups), slots, self.engine)
        # model deleted, or its hooks removed (not at exit: the process frees it all then)
        weakref.finalize(self, self.engine.close).atexit = False

    def acquire(self, group: int) -> Mapping[str, torch.Tensor] | None:
        """The group's weights on the device, or ``None``: take them the plain way."""
        if torch.is_grad_enabled():
            return None
        slot = self.ring.acquire(group)
        return None if slot is None else self.engine.views[slot][group]

    def release(self, group: int) -> None:
        """The group's compute has been issued."""
        self.ring.release(group)


@dataclass
class StreamedGroup:
    """What one offload hook holds: its pipeline and its group's index in it."""

    offload: StreamedOffload
    index: int

    def acquire(self) -> Mapping[str, torch.Tensor] | None:
        """See :meth:`StreamedOffload.acquire`."""
        return self.offload.acquire(self.index)

    def release(self) -> None:
        """See :meth:`StreamedOffload.release`."""
        self.offload.release(self.index)


def _member(weights_map: Mapping[str, torch.Tensor], name: str) -> tuple[Member, Any] | None:
    """The member for ``name`` and, for an in-memory tensor, ``(loader, key, tensor)`` to pin;
    ``None`` when the weight cannot be streamed exactly (a non-contiguous tensor, an unknown map)."""
    loader, key = weights_map, name
    if isinstance(weights_map, PrefixedDataset):
        loader, key = weights_map.dataset, weights_map.prefix + name
    if not isinstance(loader, OffloadedWeightsLoader):
        return None
    if key in loader.state_dict:
        tensor = loader.state_dict[key]
        if not tensor.is_contiguous() or tensor.device.type != "cpu":
            return None
        return Member(name, tensor.dtype, tuple(tensor.shape), tensor.nbytes), (loader, key, tensor)
    if key not in loader.index:
        return None
    info, cast = loader.location(key)
    dtype = cast or info.dtype
    nbytes = info.nbytes if cast is None else \
        torch.empty(info.shape, dtype=dtype, device="meta").nbytes
    member = Member(name, dtype, info.shape, nbytes)
    if cast is None:
        member.info = info
    else:
        member.fetch = lambda: loader[key]  # the loader's own cast, as the plain path does it
    return member, None


def stream_offloaded(hooks: Sequence[tuple[Any, Sequence[str]]], device: torch.device,
                     slots: int = OFFLOAD_SLOTS, cap: int | None = None) -> list[Any]:
    """Stream the weights of offload hooks through ``slots`` buffers on ``device``.

    In-memory weights are copied once into pinned slabs (up to ``cap`` bytes, by default
    :func:`~.pinned_slabs.pinned_cap`), which then replace them in their loader; the rest are
    read into a pinned staging ring. Each hook gets a :class:`StreamedGroup` as ``streamed``.

    Args:
        hooks: ``(AlignDevicesHook, names)`` in the order the hooks run.
        device: where they run.
        slots: device buffers (one in use, the rest prefetched).
        cap: the most bytes to pin.

    Returns:
        The hooks that were left to load their weights the plain way.

    Example:
        >>> from nbaccel.big_modeling.hooks import AlignDevicesHook
        >>> hook = AlignDevicesHook("cpu", offload=True, weights_map={"w": torch.ones(1)})
        >>> stream_offloaded([(hook, ["w"])], torch.device("cpu")) == [hook]  # not a loader
        True
    """
    plain, groups, owners, to_pin = [], [], [], []
    for hook, names in hooks:
        found = [_member(hook.weights_map, n) for n in names]
        if not names or any(f is None for f in found):
            plain.append(hook)
            continue
        groups.append([member for member, _ in found])
        owners.append(hook)
        to_pin += [(member, ram) for member, ram in found if ram is not None]
    if not groups:
        return plain
    _pin(to_pin, pinned_cap() if cap is None else cap, device.type == "cuda")
    offload = _fitting(device, groups, slots)
    if offload is None:
        return [*plain, *owners]
    for index, hook in enumerate(owners):
        hook.streamed = StreamedGroup(offload, index)
    return plain


def _fitting(device: torch.device, groups: list[list[Member]], slots: int) -> StreamedOffload | None:
    """The pipeline with as many of ``slots`` device buffers as fit (at least 2, so one group
    computes while the next arrives, unless 1 was asked for); ``None`` when fewer fit. A map made
    by ``infer_auto_device_map`` itself keeps room for one piece only, as Accelerate's does."""
    for count in range(slots, min(2, slots) - 1, -1):
        try:
            offload = StreamedOffload(device, groups, count)
        except torch.cuda.OutOfMemoryError:
            continue
        if count < slots:
            warnings.warn(f"only {count} of {slots} offload slots fit on {device}: offloaded layers "
                          "stream with less prefetch. To keep room for all of them, build the map "
                          "with load_checkpoint_and_dispatch (it reserves them) or lower max_memory "
                          f"for {device}.", stacklevel=4)
        return offload
    warnings.warn(f"no room for 2 offload slots on {device}: offloaded layers load their weights "
                  "one by one, without streaming. Fix: lower max_memory for that GPU so the map "
                  "leaves room for a few of its largest layers.", stacklevel=4)
    return None


def _pin(found: list[tuple[Member, tuple]], cap: int, pin: bool) -> None:
    """Pin each distinct in-memory tensor once; the pinned copy replaces it in its loader."""
    distinct: dict[int, torch.Tensor] = {}
    for _, (_, _, tensor) in found:
        distinct.setdefault(id(tensor), tensor)
    pinned = dict(zip(distinct, pin_tensors(list(distinct.values()), cap, pin=pin)))
    for member, (loader, key, tensor) in found:
        copy = pinned[id(tensor)]
        if copy is None:
            member.fetch = lambda t=tensor: t  # over the cap: staged from where it is
        else:
            member.direct = copy
            loader.state_dict[key] = copy
