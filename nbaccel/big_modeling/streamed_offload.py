"""Offloaded weights streamed to the execution device while the layer before them computes.

::

    CPU weights ── once, at dispatch ──► pinned slabs ───────────────┐ (copied directly)
    over the cap, or on disk ── reader threads ──► pinned staging ───┤ (one buffer per slot)
                                                                     ▼
                           copy stream: wait(slot free) · copies · record(ready)
                                                                     ▼
                      `slots` device buffers ──► compute stream: wait(ready) · layer · record(free)

:class:`~.slot_ring.SlotRing` decides which group goes into which slot;
:class:`~.slot_engine.SlotEngine` carries it out; :func:`~.offload_report.offload_report` says
what a forward cost against the bus. What always holds:

- A layer computes on the exact bytes ``weights_map`` would give (the same dtype, shape and
  values: copies of bytes, casts done as the loader does them), so outputs are bit-identical to
  loading each weight with ``.to(device)``.
- The host never waits for the device: copies and layers are ordered by CUDA events only (the
  host joins a reader thread, which has by then normally long finished).
- Slot buffers and staging buffers are owned by the engine for its whole life (no tensor of
  them is ever freed while in flight; ``record_stream`` marks the slots as used by the copy
  stream for the allocator); a staging buffer is refilled only once the copy out of it is done.
- Each offloaded byte crosses once per forward, in the order the model runs it: a group is a
  no-split block (a decoder layer, not a layer norm), the ring learns the groups' order from the
  forwards themselves and prefetches along it (so ``generate()`` starts every step warm).
- With gradients enabled, under ``torch.compile`` tracing or CUDA graph capture, a hook takes its
  weights the plain way (:func:`plain_only`); its loader's prefetch chain still reads ahead.
- On a CPU execution device the same engine runs with synchronous copies (used by the tests);
  :func:`stream_offloaded` is only attached for CUDA by ``dispatch_model``.
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nbaccel.big_modeling.offload import OffloadedWeightsLoader, PrefixedDataset
from nbaccel.big_modeling.pinned_slabs import ALIGN, pin_tensors, pinned_cap
from nbaccel.big_modeling.slot_engine import Member, PassClock, SlotEngine
from nbaccel.big_modeling.slot_ring import SlotRing

__all__ = ["OFFLOAD_SLOTS", "Member", "SlotEngine", "StreamedGroup", "StreamedOffload", "plain_only",
           "stream_offloaded"]

OFFLOAD_SLOTS = 3  # one layer computing, two on their way: hides a copy up to twice a layer's compute
AHEAD_LAYERS = 2  # prefetch no more bytes than this many of the largest group: the next one covered


def _layout(members: list[Member]) -> int:
    """Give each member an ``ALIGN``-byte offset in the slot; returns the slot bytes needed."""
    end = 0
    for m in members:
        m.offset = end
        end += -(-m.nbytes // ALIGN) * ALIGN
    return end


def plain_only(cuda: bool) -> bool:
    """Whether a hook must take its weights the plain way now: with gradients enabled (autograd
    may keep a weight for the backward pass, and a slot is overwritten by a later layer), while
    ``torch.compile`` traces the hook (threads and events are not traceable; Accelerate keeps
    its hook work out of compilation too), or while a CUDA graph is being captured (the copy
    stream's events and a reader thread's copies cannot be part of a graph).

    Example:
        >>> with torch.no_grad():
        ...     plain_only(cuda=False)
        False
    """
    if torch.is_grad_enabled() or torch.compiler.is_compiling():
        return True
    return cuda and torch.cuda.is_current_stream_capturing()


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
        sizes = [sum(m.nbytes for m in members) for members in groups]  # the bytes that cross
        self.engine = SlotEngine(device, groups, slots)
        self.ring = SlotRing(len(groups), slots, self.engine, sizes=sizes,
                             ahead_bytes=AHEAD_LAYERS * max(sizes))
        self.last_clock: PassClock | None = None  # the clock of the pass before the current one
        # model deleted, or its hooks removed (not at exit: the process frees it all then)
        weakref.finalize(self, self.engine.close).atexit = False

    def acquire(self, group: int) -> Mapping[str, torch.Tensor] | None:
        """The group's weights on the device, or ``None``: take them the plain way."""
        if plain_only(self.engine.cuda):
            return None
        start = time.perf_counter()
        if self.ring.starts_pass(group):  # a new forward: the last one's clock is complete
            self.last_clock = self.engine.clock
            self.engine.clock = PassClock(self.engine.cuda, self.engine.device)
            self.engine.clock.start = self.engine.clock.mark() if self.engine.cuda else start
        slot = self.ring.acquire(group)
        if not self.engine.cuda:  # synchronous copies: the time in the ring is time waiting for them
            self.engine.clock.waits.append((start, time.perf_counter()))
        return None if slot is None else self.engine.views[slot][group]

    def release(self, group: int) -> None:
        """The group's compute has been issued: the pass so far ends here."""
        self.ring.release(group)
        self.engine.clock.stop()


@dataclass
class StreamedGroup:
    """What one offload hook holds: its pipeline, its group's index in it, and which of the
    group's members are its own (``{its name: the member's name}``)."""

    offload: StreamedOffload
    index: int
    names: dict[str, str]

    def acquire(self) -> Mapping[str, torch.Tensor] | None:
        """See :meth:`StreamedOffload.acquire`; the hook's own weights, by its names."""
        views = self.offload.acquire(self.index)
        return None if views is None else {own: views[key] for own, key in self.names.items()}

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
                     slots: int = OFFLOAD_SLOTS, cap: int | None = None,
                     blocks: Sequence[Hashable | None] | None = None) -> list[Any]:
    """Stream the weights of offload hooks through ``slots`` buffers on ``device``.

    Hooks with the same ``blocks`` key form one group (a no-split block: a decoder layer's
    norms, attention and MLP), copied into one slot in one go, in the order the groups run. In-memory
    weights are copied once into pinned slabs (up to ``cap`` bytes, by default
    :func:`~.pinned_slabs.pinned_cap`), which then replace them in their loader; the rest are
    read into a pinned staging ring. Each hook gets a :class:`StreamedGroup` as ``streamed``.

    Args:
        hooks: ``(AlignDevicesHook, names)`` in the order the hooks were made.
        device: where they run.
        slots: device buffers (one in use, the rest prefetched).
        cap: the most bytes to pin.
        blocks: one key per hook (``None``: a group of its own); by default each hook is a group.

    Returns:
        The hooks that were left to load their weights the plain way.

    Example:
        >>> from nbaccel.big_modeling.hooks import AlignDevicesHook
        >>> hook = AlignDevicesHook("cpu", offload=True, weights_map={"w": torch.ones(1)})
        >>> stream_offloaded([(hook, ["w"])], torch.device("cpu")) == [hook]  # not a loader
        True
    """
    plain, to_pin = [], []
    grouped: dict[Hashable, list[tuple[Any, list[Member]]]] = {}
    for k, (hook, names) in enumerate(hooks):
        found = [f for f in (_member(hook.weights_map, n) for n in names) if f is not None]
        if not names or len(found) < len(names):  # a weight that cannot be streamed
            plain.append(hook)
            continue
        key = blocks[k] if blocks is not None and blocks[k] is not None else ("hook", k)
        grouped.setdefault(key, []).append((hook, [member for member, _ in found]))
        to_pin += [(member, ram) for member, ram in found if ram is not None]
    if not grouped:
        return plain
    _pin(to_pin, pinned_cap() if cap is None else cap, device.type == "cuda")
    groups: list[list[Member]] = []
    owners: list[tuple[Any, int, dict[str, str]]] = []
    for index, members in enumerate(grouped.values()):
        groups.append([])
        for position, (hook, own) in enumerate(members):
            own_names: dict[str, str] = {}
            for member in own:  # two hooks of a block may both own a "weight"
                key = f"{position}:{member.name}"
                own_names[member.name] = key
                member.name = key
                groups[-1].append(member)
            owners.append((hook, index, own_names))
    offload = _fitting(device, groups, slots)
    if offload is None:
        return [*plain, *(hook for hook, _, _ in owners)]
    for hook, index, own_names in owners:
        hook.streamed = StreamedGroup(offload, index, own_names)
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
