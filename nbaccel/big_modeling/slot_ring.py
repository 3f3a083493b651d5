"""Which offloaded group goes into which device slot, and when: the prefetch plan, device-agnostic.

An offloaded forward runs ``groups`` weight groups (a no-split block, or one offload hook) in a
cyclic order learned as it runs, on ``slots`` device buffers. :class:`SlotRing` decides; a
:class:`CopyEngine` does (a CUDA copy stream in :mod:`.streamed_offload`, a fake that records
calls in the tests). What always holds:

- A group is used only from the slot it was last copied into, and the engine is told to
  ``use`` that slot before the compute that reads it (on CUDA: the compute stream waits for the
  copy's event).
- A slot is copied into only when no acquired group is in it; the engine orders the copy after
  the slot's last ``free`` (on CUDA: the copy stream waits for the compute stream's event).
- The order is the order the groups are acquired in: each group's successor is the group
  acquired after it last time (re-learned whenever it changes); a group never followed yet is
  guessed to be followed by the next index not run yet in this pass (registration order), or,
  when all have run, by the group the passes start with. Acquiring ``g`` brings the
  groups that follow it into the other slots, up to ``slots - 1`` of them and no more than
  ``ahead_bytes`` on their way, so the copies run while ``g`` computes, and the first groups of
  the next call are already in place when the last group of this one runs (the ring wraps).
- A copy that raised (an interrupt, a failed read) leaves its slot empty, never half-filled.
- A group called out of the predicted order still gets its own weights (it is copied in on
  demand); when every slot is acquired (deeper nesting than there are slots), ``acquire``
  returns ``None`` and the caller takes the weights the plain way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from nbaccel.errors import ConfigError, EnvironmentStateError

__all__ = ["CopyEngine", "PassStats", "SlotRing"]


@dataclass
class PassStats:
    """What one pass over the groups (one forward) cost: copies, their bytes, and demand misses
    (a group acquired when no slot held it, so its compute waited for its whole copy)."""

    copies: int = 0
    bytes: int = 0
    misses: int = 0
    acquired: int = 0  # distinct groups acquired (top-level calls)


class CopyEngine(Protocol):
    """The three things the ring asks of a copy engine; all may return before the work is done."""

    def copy_in(self, slot: int, group: int) -> None:
        """Bring ``group``'s weights into ``slot``, after everything freed from ``slot`` so far."""

    def use(self, slot: int) -> None:
        """Make the compute that follows wait for the last copy into ``slot``."""

    def free(self, slot: int) -> None:
        """Mark the compute issued so far as the last use of ``slot``'s current contents."""


class SlotRing:
    """The slot plan for ``groups`` weight groups over ``slots`` device buffers.

    Args:
        groups: how many groups, in their predicted order of use.
        slots: how many device buffers (one in use plus ``slots - 1`` prefetched).
        engine: what carries out the copies.
        sizes: each group's bytes (for ``ahead_bytes`` and the statistics); 1 each by default.
        ahead_bytes: the most bytes prefetched ahead of the group in use (``None``: no limit but
            the slots).

    Example:
        >>> class Log:
        ...     def __init__(self): self.calls = []
        ...     def copy_in(self, slot, group): self.calls.append(("copy", slot, group))
        ...     def use(self, slot): self.calls.append(("use", slot))
        ...     def free(self, slot): self.calls.append(("free", slot))
        >>> log = Log(); ring = SlotRing(4, 2, log)
        >>> ring.acquire(0), log.calls
        (0, [('copy', 0, 0), ('use', 0), ('copy', 1, 1)])
    """

    def __init__(self, groups: int, slots: int, engine: CopyEngine,
                 sizes: Sequence[int] | None = None, ahead_bytes: int | None = None) -> None:
        if groups < 1 or slots < 1:
            raise ConfigError(f"a slot ring needs at least one group and one slot (got groups={groups}, "
                              f"slots={slots}). Fix: pass slots >= 1 and at least one offloaded group.",
                              key="slots" if groups >= 1 else "groups",
                              value=slots if groups >= 1 else groups, valid="an int >= 1")
        self.groups, self.slots, self.engine = groups, slots, engine
        self.holds: list[int | None] = [None] * slots  # the group each slot holds
        self.busy = [0] * slots  # acquisitions not yet released (nested calls count)
        self.last_use = [0] * slots
        self._clock = 0
        self.sizes = list(sizes) if sizes is not None else [1] * groups
        self.ahead_bytes = ahead_bytes
        self.after: list[int | None] = [None] * groups  # learned: the group acquired after each
        self.first: int | None = None  # the group a pass starts with (the first ever acquired)
        self.last: int | None = None  # the group acquired last (top-level)
        self.passes = 0  # passes started
        self.seen: set[int] = set()  # groups acquired in the current pass
        self.current = PassStats()  # the pass running now
        self.previous: PassStats | None = None  # the last complete pass

    def slot_of(self, group: int) -> int | None:
        """The slot holding ``group``, or ``None``."""
        return next((s for s, g in enumerate(self.holds) if g == group), None)

    def acquire(self, group: int) -> int | None:
        """Make ``group``'s weights usable by the compute that follows; prefetch the next ones.

        Returns:
            The slot that holds them, or ``None`` when every slot is acquired.
        """
        slot = self.slot_of(group)
        if slot is None or self.busy[slot] == 0:
            self._learn(group)
        if slot is None:
            slot = self._victim(keep={group})
            if slot is None:
                return None
            self.current.misses += 1
            self._load(slot, group)
        try:
            self.engine.use(slot)
        except BaseException:
            self.holds[slot] = None  # the copy failed (a file cut short): copy again next time
            raise
        self.busy[slot] += 1
        self._clock += 1
        self.last_use[slot] = self._clock
        try:
            self._prefetch(group)
        except BaseException:  # an interrupt while prefetching: the caller never gets the slot
            self.release(group)
            raise
        return slot

    def starts_pass(self, group: int) -> bool:
        """Whether acquiring ``group`` now starts a pass (a forward) over the groups."""
        return (self.first is None or group == self.first) and group != self.last

    def _learn(self, group: int) -> None:
        """Record that ``group`` follows the last group acquired; a pass starts at ``first``."""
        if group == self.last:
            return
        if self.last is not None:
            self.after[self.last] = group
        if self.first is None:
            self.first = group
        if group == self.first:
            self.passes += 1
            if self.passes > 1:
                self.previous = self.current
            self.current = PassStats()
            self.seen = set()
        self.seen.add(group)
        self.current.acquired += 1
        self.last = group

    def release(self, group: int) -> None:
        """The compute that reads ``group`` has been issued; its slot may be reused after it."""
        slot = self.slot_of(group)
        if slot is None or self.busy[slot] == 0:
            raise EnvironmentStateError(
                f"group {group} was released without being acquired (slots hold {self.holds}, "
                f"acquired {self.busy}). Fix: call release(group) once per acquire(group) that "
                "returned a slot.")
        self.busy[slot] -= 1
        if self.busy[slot] == 0:
            self.engine.free(slot)

    def upcoming(self, group: int) -> list[int]:
        """The groups prefetched while ``group`` runs, nearest first."""
        depth = min(self.slots - 1, self.groups - 1)
        window: list[int] = []
        on_the_way, nxt = 0, group
        while len(window) < depth and (self.ahead_bytes is None or on_the_way < self.ahead_bytes):
            learned = self.after[nxt]
            nxt = learned if learned is not None else self._guess(nxt, {group, *window})
            if nxt == group or nxt in window:
                break  # a cycle shorter than the window: everything in it is on its way
            window.append(nxt)
            on_the_way += self.sizes[nxt]
        return window

    def _guess(self, group: int, ahead: set[int]) -> int:
        """The successor of a group never followed yet: the next index not run in this pass (nor
        already ``ahead``), else the group passes start with (the ring wraps)."""
        for j in range(1, self.groups):
            nxt = (group + j) % self.groups
            if nxt not in self.seen and nxt not in ahead:
                return nxt
        return self.first if self.first is not None else (group + 1) % self.groups

    def _prefetch(self, group: int) -> None:
        window = self.upcoming(group)
        keep = {group, *window}
        for nxt in window:
            if self.slot_of(nxt) is not None:
                continue
            slot = self._victim(keep)
            if slot is None:
                return
            self._load(slot, nxt)

    def _victim(self, keep: set[int]) -> int | None:
        """An idle slot whose group is not wanted soon: an empty one, else the least recently used."""
        idle = [s for s in range(self.slots) if self.busy[s] == 0 and self.holds[s] not in keep]
        if not idle:
            return None
        empty = [s for s in idle if self.holds[s] is None]
        return empty[0] if empty else min(idle, key=lambda s: self.last_use[s])

    def _load(self, slot: int, group: int) -> None:
        # empty until the copy is issued: an interrupt inside copy_in leaves no half-copied group
        self.holds[slot] = None
        self.engine.copy_in(slot, group)
        self.holds[slot] = group
        self.current.copies += 1
        self.current.bytes += self.sizes[group]
