"""The same behaviour tests (tests/behaviour_cases.py) here: a one-shot launch, a warm pool, one-process ranks.

- ``oneshot``: ``notebook_launcher(fn, num_processes=2, use_cpu=True)``, fresh workers every run.
- ``pool``: one ``WorkerPool(num_processes=2, use_cpu=True)`` for the module; ``pool.run(fn)``, or
  ``pool.launch(pool.request(fn, observer=...))`` when a test watches the run.
- ``warm1``: ``notebook_launcher(fn, num_processes=1, use_cpu=True)``, which may run on a hidden warm
  rank kept by the kernel; it must still look like a fresh run.
- ``fresh1``: the same with ``fresh=True`` (a new process, never the warm rank); skipped where
  ``notebook_launcher`` has no ``fresh`` option.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from nbaccel import WorkerPool, notebook_launcher
from tests.behaviour_cases import *  # noqa: F403 - the behaviours, run here against this file's variants
from tests.behaviour_cases import (
    PoolVariant,
    Variant,
    answer,
    kernel_like_shell,
    wait_for,
)

from .procs import alive, children


class Launch(Variant):
    """``notebook_launcher`` with this variant's options, a fresh run each time."""

    def __init__(self, name: str, num_processes: int, *, leaves_nothing: bool = True, **options: Any) -> None:
        self.name, self.num_processes, self.options = name, num_processes, options
        self.leaves_nothing = leaves_nothing

    def run(self, function: Callable[..., Any], *args: Any, observer: Any = None, return_all: bool = False,
            output_ranks: list[int] | None = None) -> Any:
        return notebook_launcher(function, args, num_processes=self.num_processes, use_cpu=True, observer=observer,
                                 return_all=return_all, output_ranks=output_ranks, **self.options)

    @contextlib.contextmanager
    def with_timeout(self, seconds: float) -> Iterator[Variant]:
        yield Launch(self.name, self.num_processes, leaves_nothing=self.leaves_nothing,
                     **{**self.options, "timeout": seconds})

    def check_after_interrupt(self, pids: list[int]) -> None:
        if self.leaves_nothing:  # a one-shot launch: no worker outlives it
            assert wait_for(lambda: not any(alive(p) for p in pids), 10.0), [p for p in pids if alive(p)]
            assert children() == []


def _has_fresh_option() -> bool:
    return "fresh" in inspect.signature(notebook_launcher).parameters


@pytest.fixture(scope="module", params=["oneshot", "pool", "warm1", "fresh1"])
def runner(request):
    """Made before each test's leftover check starts counting, so a kept pool or warm rank is not a leftover."""
    kernel_like_shell()
    if request.param == "oneshot":
        yield Launch("oneshot", 2)
    elif request.param == "pool":
        with WorkerPool(num_processes=2, use_cpu=True) as pool:
            yield PoolVariant("pool", pool)
    elif request.param == "warm1":
        warm = Launch("warm1", 1, leaves_nothing=False)
        warm.keeps_modules = True  # the kept rank's imported modules stay (nbaccel.launch.pool.warm)
        assert warm.run(answer) == 42  # the warm rank, where there is one, starts here
        yield warm
    else:
        if not _has_fresh_option():
            pytest.skip("notebook_launcher has no fresh= option yet (issue 26: fresh=True forces a new process)")
        yield Launch("fresh1", 1, fresh=True)


@pytest.fixture(autouse=True)
def _a_pool_broken_by_an_earlier_test_is_restarted(runner):
    """One broken pool fails the test that broke it, not every test after it."""
    if isinstance(runner, PoolVariant) and not runner.pool.alive:
        runner.pool.restart()
    yield
