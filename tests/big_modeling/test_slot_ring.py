"""The prefetch plan (SlotRing) and the pinned-slab packing, with the copy engine faked."""

from __future__ import annotations

import itertools

import pytest
import torch

from nbaccel.big_modeling.pinned_slabs import ALIGN, pack, pin_tensors, pinned_cap
from nbaccel.big_modeling.slot_ring import SlotRing
from nbaccel.errors import ConfigError, EnvironmentStateError


class FakeEngine:
    """Records the ring's calls and checks, as a GPU would need, that every read sees the right
    group and that no slot is overwritten while a group in it is acquired."""

    def __init__(self, slots: int) -> None:
        self.calls: list[tuple] = []
        self.content: list[int | None] = [None] * slots
        self.in_use = [0] * slots

    def copy_in(self, slot: int, group: int) -> None:
        assert self.in_use[slot] == 0, f"copy into slot {slot} while it is in use"
        self.content[slot] = group
        self.calls.append(("copy", slot, group))

    def use(self, slot: int) -> None:
        self.in_use[slot] += 1
        self.calls.append(("use", slot))

    def free(self, slot: int) -> None:
        self.in_use[slot] = 0
        self.calls.append(("free", slot))


def _forward(ring: SlotRing, engine: FakeEngine, order: list[int]) -> list[tuple]:
    start = len(engine.calls)
    for group in order:
        slot = ring.acquire(group)
        assert engine.content[slot] == group  # the compute reads its own weights
        ring.release(group)
    return engine.calls[start:]


def test_first_forward_prefetches_the_next_groups_in_order() -> None:
    engine = FakeEngine(3)
    ring = SlotRing(5, 3, engine)
    calls = _forward(ring, engine, [0, 1])
    assert calls == [("copy", 0, 0), ("use", 0), ("copy", 1, 1), ("copy", 2, 2), ("free", 0),
                     ("use", 1), ("copy", 0, 3), ("free", 1)]


def test_the_ring_wraps_around_so_the_next_forward_starts_warm() -> None:
    engine = FakeEngine(3)
    ring = SlotRing(5, 3, engine)
    _forward(ring, engine, list(range(5)))
    assert sorted(g for g in ring.holds) == [0, 1, 4]  # the next forward's first two are there
    second = _forward(ring, engine, list(range(5)))
    copies = [c for c in second if c[0] == "copy"]
    assert copies[0][2] == 2  # group 0 was not copied again: the first copy is group 2
    assert [g for *_, g in copies] == [2, 3, 4, 0, 1]  # each group copied once per forward


def test_every_copy_waits_for_the_slot_to_be_freed() -> None:
    engine = FakeEngine(2)
    ring = SlotRing(7, 2, engine)
    for _ in range(3):
        _forward(ring, engine, list(range(7)))  # FakeEngine asserts no overwrite while in use
    copies = [c for c in engine.calls if c[0] == "copy"]
    assert len(copies) == 3 * 7 + 1  # once per group per forward, and the next forward's first


def test_groups_that_fit_in_the_slots_are_copied_once() -> None:
    engine = FakeEngine(3)
    ring = SlotRing(3, 3, engine)
    _forward(ring, engine, [0, 1, 2])
    assert not [c for c in _forward(ring, engine, [0, 1, 2] * 3) if c[0] == "copy"]


def test_out_of_order_and_nested_calls_still_read_their_own_group() -> None:
    engine = FakeEngine(3)
    ring = SlotRing(6, 3, engine)
    for group in [0, 3, 3, 5, 1, 0, 2, 4, 4, 1]:
        assert engine.content[ring.acquire(group)] == group
        ring.release(group)
    outer = ring.acquire(0)
    inner = ring.acquire(4)  # a nested call: both stay in place while both are in use
    assert engine.content[outer] == 0 and engine.content[inner] == 4 and outer != inner
    ring.release(4)
    ring.release(0)


def test_when_every_slot_is_in_use_acquire_says_take_the_plain_way() -> None:
    engine = FakeEngine(2)
    ring = SlotRing(4, 2, engine)
    ring.acquire(0)
    ring.acquire(1)
    assert ring.acquire(2) is None
    ring.release(1)
    assert engine.content[ring.acquire(2)] == 2


def test_many_random_orders_keep_the_invariants() -> None:
    gen = torch.Generator().manual_seed(0)
    for groups, slots in itertools.product((1, 2, 5, 9), (1, 2, 3, 4)):
        engine = FakeEngine(slots)
        ring = SlotRing(groups, slots, engine)
        order = torch.randint(0, groups, (40,), generator=gen).tolist()
        _forward(ring, engine, order + list(range(groups)) * 2)


def test_bad_sizes_and_unbalanced_release_are_errors() -> None:
    with pytest.raises(ConfigError) as info:
        SlotRing(3, 0, FakeEngine(1))
    assert info.value.key == "slots" and info.value.value == 0
    with pytest.raises(ConfigError) as info:
        SlotRing(0, 2, FakeEngine(2))
    assert info.value.key == "groups"
    ring = SlotRing(3, 2, FakeEngine(2))
    with pytest.raises(EnvironmentStateError, match="released without being acquired"):
        ring.release(1)


def test_pack_makes_slabs_of_exactly_what_they_hold_within_the_cap() -> None:
    sizes = [3000, 100, 700, 4096, 1, 0, 2500]
    slabs, places = pack(sizes, cap=2**20, slab_bytes=4096)
    held = {}
    for size, where in zip(sizes, places):
        if where is not None:
            held[where.slab] = held.get(where.slab, 0) + -(-size // ALIGN) * ALIGN
    assert slabs == [held[k] for k in range(len(slabs))]  # not rounded up to a power of two
    spans = {}
    for size, where in zip(sizes, places):
        if size == 0:
            assert where is None
            continue
        assert where.offset % ALIGN == 0 and where.offset + size <= slabs[where.slab]
        spans.setdefault(where.slab, []).append((where.offset, where.offset + size))
    for ranges in spans.values():  # no two tensors overlap
        ranges.sort()
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(ranges))
    assert sum(slabs) < sum(sizes) + ALIGN * len(sizes)


def test_pack_never_passes_the_cap_and_leaves_the_rest_unpinned() -> None:
    sizes = [1000] * 20
    slabs, places = pack(sizes, cap=5000, slab_bytes=2048)
    assert sum(slabs) <= 5000
    assert 0 < sum(p is not None for p in places) < 20


def test_a_tensor_larger_than_a_slab_gets_a_larger_slab() -> None:
    slabs, places = pack([10_000, 10], cap=2**20, slab_bytes=1024)
    assert slabs == [10240, 512] and places[0].slab == 0  # exact: no 16 KiB power of two


def test_pin_tensors_copies_values_dtype_and_shape() -> None:
    tensors = [torch.randn(3, 5), torch.arange(7, dtype=torch.int64), torch.ones(0),
               torch.randn(4, dtype=torch.float64).to(torch.bfloat16)]
    out = pin_tensors(tensors, cap=2**20, pin=False)
    for t, copy in zip(tensors[:2] + tensors[3:], out[:2] + out[3:]):
        assert copy.dtype == t.dtype and copy.shape == t.shape and torch.equal(copy, t)
        assert copy.data_ptr() != t.data_ptr()
    assert out[2] is None  # nothing to pin
    assert pin_tensors([torch.ones(1000)], cap=100, pin=False) == [None]
    assert pinned_cap(0.5) <= pinned_cap(1.0)


def test_a_failed_copy_is_not_used_later() -> None:
    class Failing(FakeEngine):
        fail = True

        def use(self, slot: int) -> None:
            if self.fail:
                raise OSError("read failed")
            super().use(slot)

    engine = Failing(2)
    ring = SlotRing(3, 2, engine)
    with pytest.raises(OSError):
        ring.acquire(0)
    assert ring.holds == [None, None] and ring.busy == [0, 0]
    engine.fail = False
    assert engine.content[ring.acquire(0)] == 0


def test_the_ring_learns_the_order_the_groups_run_in() -> None:
    """Registered 0..5, run 2, 0, 1, 5, 3, 4 (norms before attention, say): after the first pass,
    each group is copied once per pass and never missed; before, the ring prefetched by index."""
    engine = FakeEngine(3)
    ring = SlotRing(6, 3, engine)
    order = [2, 0, 1, 5, 3, 4]
    _forward(ring, engine, order)
    for _ in range(3):
        _forward(ring, engine, order)
        assert (ring.current.acquired, ring.current.copies, ring.current.misses) == (6, 6, 0)
    changed = [4, 3, 5, 1, 0, 2]  # the order changes: learned again in one pass and the wrap
    _forward(ring, engine, changed)
    _forward(ring, engine, changed)
    calls = _forward(ring, engine, changed)
    demand = [c for c, nxt in itertools.pairwise(calls) if c[0] == "copy" and nxt == ("use", c[1])]
    assert sorted(g for kind, *_, g in calls if kind == "copy") == list(range(6)) and not demand


def test_prefetch_stops_at_the_bytes_ahead_limit() -> None:
    engine = FakeEngine(4)
    ring = SlotRing(5, 4, engine, sizes=[100, 1, 100, 100, 100], ahead_bytes=101)
    assert ring.upcoming(0) == [1, 2]  # a small group does not count as a layer covered
    assert ring.upcoming(2) == [3, 4]
    assert SlotRing(5, 4, engine).upcoming(0) == [1, 2, 3]  # no limit but the slots


def test_an_interrupt_inside_a_copy_or_a_prefetch_leaves_no_half_copied_slot() -> None:
    class Interrupted(FakeEngine):
        fail_at: int | None = None

        def copy_in(self, slot: int, group: int) -> None:
            if group == self.fail_at:
                raise KeyboardInterrupt
            super().copy_in(slot, group)

    engine = Interrupted(3)
    ring = SlotRing(5, 3, engine)
    engine.fail_at = 0
    with pytest.raises(KeyboardInterrupt):
        ring.acquire(0)
    assert ring.holds == [None] * 3
    engine.fail_at = 2  # the prefetch of group 2 is interrupted
    with pytest.raises(KeyboardInterrupt):
        ring.acquire(1)
    assert 2 not in ring.holds and ring.busy == [0] * 3  # the caller never got group 1's slot
    engine.fail_at = None
    assert engine.content[ring.acquire(2)] == 2
