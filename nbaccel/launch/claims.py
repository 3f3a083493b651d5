"""What background runs hold (GPUs, the warm one-process rank, a warm pool), and refusing launches that need it.

A background run (:mod:`nbaccel.runs`) keeps the devices it uses until it ends. A second launch or
pool that needs one of them is refused up front with a :class:`RunBusyError` naming the run and
how to wait for or cancel it, rather than waiting in silence or failing inside CUDA. CPU processes
are not held. The check runs before every launch (:func:`refuse_claimed`, first in
:func:`nbaccel.launch.registry.run_before_launch`) and before a pool's run (:func:`refuse_held`);
a run's own thread is never refused by its own claim.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from nbaccel.errors import EnvironmentStateError
from nbaccel.launch.base import LaunchRequest

__all__ = ["ALL_GPUS", "WARM_RANK", "Claim", "RunBusyError", "cancel_holders", "claim", "claimed_by_this_thread",
           "needed_by", "pool_resource", "refuse_claimed", "refuse_held", "release"]

WARM_RANK = "the warm one-process rank"
ALL_GPUS = "every GPU"


class RunBusyError(EnvironmentStateError):
    """A background run holds what this launch or pool needs.

    Attributes:
        run_id: the run holding it (``%accel_runs`` lists it).
        resources: what is held, e.g. ``("GPU 0",)``, ``("every GPU",)`` or ``("the warm one-process rank",)``.
    """

    def __init__(self, msg: str, *, run_id: int, resources: tuple[str, ...]) -> None:
        super().__init__(msg)
        self.run_id = run_id
        self.resources = resources


@dataclass(frozen=True)
class Claim:
    """One run's hold on ``resources``; ``label`` names the run in errors (``"run 3 (In[7])"``); ``cancel`` stops it."""

    token: int
    run_id: int
    label: str
    resources: frozenset[str]
    cancel: Callable[[], object] | None = field(default=None, compare=False)


_FRESH_HINT = "; or start a new process for it: fresh=True (%%accel_launch --fresh)"
_lock = threading.Lock()
_claims: dict[int, Claim] = {}
_tokens = itertools.count(1)
_mine = threading.local()  # the claim of the run whose launch this thread carries out


def pool_resource(pool: object) -> str:
    """The resource name of a warm pool (one run at a time)."""
    return f"pool:{id(pool):x}"


def needed_by(request: LaunchRequest) -> frozenset[str]:
    """What ``request`` holds while it runs: its GPUs, the warm rank, or its pool."""
    needed: set[str] = set()
    if request.launcher == "warm":
        needed.add(WARM_RANK)
    if request.plan.device_kind == "cuda":
        visible = request.plan.visible_gpus
        needed |= {f"GPU {g.strip()}" for g in visible.split(",") if g.strip()} if visible else {ALL_GPUS}
    return frozenset(needed)


def claim(run_id: int, label: str, resources: Iterable[str], cancel: Callable[[], object] | None = None) -> Claim:
    """Hold ``resources`` for run ``run_id`` (stopped by ``cancel``); :func:`release` gives them back.

    Raises:
        RunBusyError: another run holds one of them.
    """
    wanted = frozenset(resources)
    with _lock:
        _refuse_locked(wanted, "this run")
        held = Claim(next(_tokens), run_id, label, wanted, cancel)
        _claims[held.token] = held
    return held


def release(held: Claim) -> None:
    """Give back what ``held`` holds (safe to call twice)."""
    with _lock:
        _claims.pop(held.token, None)


def claimed_by_this_thread(held: Claim | None) -> None:
    """Mark this thread as carrying out ``held``'s run: its own claim never refuses it (``None`` unmarks)."""
    _mine.token = held.token if held is not None else None


def _is_gpu(resource: str) -> bool:
    return resource == ALL_GPUS or resource.startswith("GPU ")


def _overlap(wanted: frozenset[str], held: frozenset[str]) -> tuple[str, ...]:
    both = wanted & held
    if not both and (ALL_GPUS in wanted or ALL_GPUS in held):  # every GPU overlaps any one of them
        gpus_wanted = {r for r in wanted if _is_gpu(r)}
        gpus_held = {r for r in held if _is_gpu(r)}
        if gpus_wanted and gpus_held:
            both = frozenset(gpus_held)
    return tuple(sorted(both))


def _refuse_locked(wanted: frozenset[str], what: str) -> None:
    mine = getattr(_mine, "token", None)
    for held in _claims.values():
        overlap = _overlap(wanted, held.resources)
        if held.token != mine and overlap:
            raise RunBusyError(
                f"{what} needs {', '.join(overlap)}, which background {held.label} holds until it ends. "
                f"Valid: a launch that needs none of {sorted(held.resources)} while it runs. Fix: wait for it "
                f"(run.wait(), or %accel_runs to see it), or cancel it (%accel_runs cancel {held.run_id}), "
                f"then run this again{_FRESH_HINT if WARM_RANK in overlap else ''}.", run_id=held.run_id,
                resources=overlap)


def refuse_held(resources: Iterable[str], what: str) -> None:
    """Refuse ``what`` when a background run (not this thread's) holds one of ``resources``.

    Raises:
        RunBusyError: a background run holds one of them.
    """
    with _lock:
        _refuse_locked(frozenset(resources), what)


def cancel_holders(resources: Iterable[str]) -> list[int]:
    """Cancel the background runs holding any of ``resources`` (their pool or warm rank is being closed); their ids."""
    wanted, mine = frozenset(resources), getattr(_mine, "token", None)
    with _lock:
        holders = [c for c in _claims.values() if c.token != mine
                   and c.cancel is not None and _overlap(wanted, c.resources)]
    for holder in holders:  # outside the lock: a cancel waits for the run's thread, which releases its claim
        holder.cancel()  # type: ignore[misc]  # cancel is not None: filtered above
    return [holder.run_id for holder in holders]


def refuse_claimed(request: LaunchRequest) -> None:
    """The before-launch hook: refuse ``request`` when a background run holds what it needs.

    Raises:
        RunBusyError: a background run holds one of its GPUs, or the warm rank it would run on.
    """
    needed = needed_by(request)
    if needed and _claims:
        refuse_held(needed, "this launch" if request.launcher != "pool" else "this WorkerPool")
