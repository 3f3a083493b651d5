"""The same behaviour tests (tests/behaviour_cases.py) on Ray: a one-shot launch and a pool of rank actors.

- ``ray_oneshot``: ``notebook_launcher(fn, num_processes=2, backend="ray", use_cpu=True)``: actors
  placed, run once, killed.
- ``ray_pool``: one ``WorkerPool(2, use_cpu=True, backend="ray")`` for the module; ``pool.run(fn)``,
  or ``pool.launch(pool.request(fn, observer=...))`` when a test watches the run.

Run by ``bash scripts/test_ray.sh`` (a loopback-only network namespace; see conftest.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from nbaccel import WorkerPool, notebook_launcher
from tests.behaviour_cases import *  # noqa: F403 - the behaviours, run here against this file's variants
from tests.behaviour_cases import PoolVariant, Variant, kernel_like_shell
from tests.ray.conftest import wait_until_clean


class RayLaunch(Variant):
    """``notebook_launcher(..., backend="ray")``: new actors for every run, none left after it."""

    forks_caller = False

    def __init__(self, name: str, num_processes: int, **options: Any) -> None:
        self.name, self.num_processes, self.options = name, num_processes, options

    def run(self, function: Callable[..., Any], *args: Any, observer: Any = None, return_all: bool = False,
            output_ranks: list[int] | None = None) -> Any:
        return notebook_launcher(function, args, num_processes=self.num_processes, backend="ray", use_cpu=True,
                                 observer=observer, return_all=return_all, output_ranks=output_ranks, **self.options)

    @contextlib.contextmanager
    def with_timeout(self, seconds: float) -> Iterator[Variant]:
        yield RayLaunch(self.name, self.num_processes, **{**self.options, "timeout": seconds})

    def check_after_interrupt(self, pids: list[int]) -> None:
        assert wait_until_clean() == ([], [])  # no actor, no placement group left on the cluster


@pytest.fixture(scope="module", params=["ray_oneshot", "ray_pool"])
def runner(request, ray_cluster):
    kernel_like_shell()
    if request.param == "ray_oneshot":
        yield RayLaunch("ray_oneshot", 2)
    else:
        with WorkerPool(2, use_cpu=True, backend="ray") as pool:
            yield PoolVariant("ray_pool", pool)
        assert wait_until_clean() == ([], [])


@pytest.fixture(autouse=True)
def _a_pool_broken_by_an_earlier_test_is_restarted(runner):
    """One broken pool fails the test that broke it, not every test after it."""
    if isinstance(runner, PoolVariant) and not runner.pool.alive:
        runner.pool.restart()
    yield
