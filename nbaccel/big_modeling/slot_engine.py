"""The copy engine of the streamed offload: device slots, a copy stream, a staging ring filled by
reader threads, and a clock of where a forward's time went.

What always holds (see :mod:`.streamed_offload` for the whole pipeline):

- No copy outlives the slot it was for: a reader's job is forgotten only once it has finished,
  so when the caller is interrupted (Ctrl-C) while waiting for it, the next copy into that slot
  first waits for it, and its bytes never land over another group's.
- The host never waits for the device: copies and layers are ordered by CUDA events only (the
  host joins a reader thread, which has by then normally long finished).
- Slot and staging buffers are owned by the engine for its whole life; a staging buffer is
  refilled only once the copy out of it is done.
- On a CPU device copies are synchronous (what the tests drive).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from nbaccel.big_modeling.checkpoint_files import TensorInfo
from nbaccel.big_modeling.cpu_copies import copy_threads
from nbaccel.big_modeling.pinned_slabs import ALIGN, host_buffer, unpin
from nbaccel.big_modeling.staging_reads import SplitReads
from nbaccel.big_modeling.tensors import cpu_memoryview

__all__ = ["READERS", "Member", "PassClock", "SlotEngine"]

READERS = 4  # threads reading disk (or pageable RAM) into the staging ring
_RELEASED = object()  # a slot released since its last copy, its free event not recorded yet


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


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


@dataclass
class PassClock:
    """Where one pass's (one forward's) time went: its span and the time spent waiting for copies.

    On CUDA both are CUDA events (timing), read only when a report asks (the host never waits
    for them during a forward); on CPU they are ``time.perf_counter`` seconds.
    """

    cuda: bool
    device: torch.device | None = None  # the CUDA device whose current stream is timed
    start: Any = None
    end: Any = None
    waits: list[tuple[Any, Any]] = field(default_factory=list)

    def mark(self) -> Any:
        """Now, on the current stream (CUDA) or the host clock."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def stop(self) -> None:
        """The pass ends here so far (on CUDA one event, recorded again at each release)."""
        if not self.cuda:
            self.end = time.perf_counter()
            return
        if self.end is None:
            self.end = torch.cuda.Event(enable_timing=True)
        self.end.record(torch.cuda.current_stream(self.device))

    def seconds(self) -> tuple[float, float] | None:
        """``(span, copy wait)`` in seconds, or ``None`` before the pass ran."""
        if self.start is None or self.end is None:
            return None
        if not self.cuda:
            return self.end - self.start, sum(b - a for a, b in self.waits)
        self.end.synchronize()
        wait = sum(a.elapsed_time(b) for a, b in self.waits) / 1e3
        return self.start.elapsed_time(self.end) / 1e3, wait


class SlotEngine:
    """Copies groups into ``slots`` device buffers of ``device`` (see the module docstring).

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
        self.waited: list[Any] = [None] * slots  # (ready event, stream) a compute stream waits for
        self.jobs: list[Future | None] = [None] * slots
        self.pool = ThreadPoolExecutor(readers, thread_name_prefix="nbaccel-offload-read") \
            if staged else None
        # every reader on every group's pieces; as many as the copies may use (up to 8) where more
        self.reads = SplitReads(max(readers, copy_threads())) if staged else None
        self.clock = PassClock(self.cuda, device)

    def _views(self, slot: int, members: list[Member]) -> dict[str, torch.Tensor]:
        base = slot * self.slot_bytes
        return {m.name: (self.buffers[base + m.offset:base + m.offset + m.nbytes]
                         .view(m.dtype).view(m.shape)) if m.nbytes else
                torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in members}

    def _staging(self) -> torch.Tensor:
        """The staging ring; called for staged members only (no `direct`, some bytes), so it exists."""
        assert self.staging is not None, "__init__ makes the staging ring when a staged member exists"
        return self.staging

    def _reads(self) -> SplitReads:
        """The split readers; called only where the reader pool exists (both are made for staged members)."""
        assert self.reads is not None, "__init__ makes the readers with the reader pool"
        return self.reads

    def _context(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def copy_in(self, slot: int, group: int) -> None:
        """Bring ``group`` into ``slot`` after the slot's last use: directly, or on a reader."""
        self._join(slot)  # a copy into this slot still being issued (or interrupted) goes first
        if self.freed[slot] is _RELEASED:
            # Recorded now rather than at each release (a block's every submodule releases): the
            # compute queued so far includes the slot's last use, and the group about to compute
            # is never the one evicted, so waiting for it costs no overlap.
            self.freed[slot] = torch.cuda.Event()
            self.freed[slot].record(torch.cuda.current_stream(self.device))
        freed = self.freed[slot]
        if any(m.direct is None and m.nbytes for m in self.groups[group]):
            assert self.pool is not None, "a staged member exists, so __init__ made the reader pool"
            self.jobs[slot] = self.pool.submit(self._staged_copy, slot, group, freed)
        else:
            self.ready[slot] = self._issue(slot, group, freed)

    def use(self, slot: int) -> None:
        """Make the current stream wait for the slot's last copy (no host wait)."""
        self._join(slot)
        if not self.cuda or self.ready[slot] is None:
            return
        stream = torch.cuda.current_stream(self.device)
        if self.waited[slot] == (self.ready[slot], stream):
            return  # this stream already waits for that copy (another submodule of the block)
        before = self.clock.mark()
        stream.wait_event(self.ready[slot])
        self.clock.waits.append((before, self.clock.mark()))
        self.waited[slot] = (self.ready[slot], stream)

    def free(self, slot: int) -> None:
        """Everything queued on the current stream so far may still read the slot: a copy into it
        waits for that (the event is recorded when the next copy into the slot is issued)."""
        if self.cuda:
            self.freed[slot] = _RELEASED

    def _join(self, slot: int) -> None:
        job = self.jobs[slot]
        if job is None:
            return
        try:
            job.result()  # a reader's error (a file cut short) is raised here, in the caller
        finally:
            if job.done():  # interrupted while waiting: keep it, the next copy here waits for it
                self.jobs[slot] = None

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
                    self._staging()[base + m.offset:base + m.offset + m.nbytes]
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
            target = self._staging()[base + m.offset:base + m.offset + m.nbytes]
            if m.info is not None:
                parts.append((m.info, cpu_memoryview(target)))
            else:
                assert m.fetch is not None, "a member has `direct`, `info` or `fetch` (see streamed_offload)"
                target.copy_(_bytes(m.fetch()))
        self._reads().read(parts)
        self.ready[slot] = self.staged[slot] = self._issue(slot, group, freed)

    def close(self) -> None:
        """Stop the reader threads (after the reads in flight) and give back the page-locked
        host memory (the tensors stay valid, pageable); called when the pipeline goes."""
        if self.pool is not None:
            # the collector may run this on one of the readers (a thread cannot join itself)
            joined = not threading.current_thread().name.startswith("nbaccel-offload")
            self.pool.shutdown(wait=joined)
            self._reads().close(wait=joined)
        if self.stream is not None:
            self.stream.synchronize()  # no copy out of host memory outlives its registration
        unpin([self.staging, *(m.direct for g in self.groups for m in g)])
