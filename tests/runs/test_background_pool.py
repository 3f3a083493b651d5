"""WorkerPool.run(..., background=True): the same results, a cancel that keeps the pool, and a pool held while it
runs."""

from __future__ import annotations

import os
import time

import pytest

from nbaccel import WorkerFailedError, WorkerPool
from nbaccel.launch.claims import RunBusyError, pool_resource

from ..pool.helpers import pid_and_rank, sleep_until_cancelled, wait_for
from .helpers import fail_on_rank_one

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(num_processes=2, use_cpu=True, grace=1.0) as shared:
        yield shared


def test_a_background_pool_run_returns_at_once_with_the_blocking_runs_result(pool):
    blocking = pool.run(pid_and_rank, return_all=True)
    started = time.monotonic()
    run = pool.run(pid_and_rank, return_all=True, background=True)
    assert time.monotonic() - started < 0.5
    assert run.result(timeout=60) == blocking == {0: (pool.pids[0], 0), 1: (pool.pids[1], 1)}
    assert run.state == "finished" and run.cell == "pid_and_rank"


def test_a_failing_rank_raises_the_same_family_and_the_pool_stays(pool):
    run = pool.run(fail_on_rank_one, background=True)
    with pytest.raises(WorkerFailedError) as failed:
        run.result(timeout=60)
    assert isinstance(failed.value, KeyError) and failed.value.failures[0].rank == 1
    assert pool.alive and pool.run(lambda: 5) == 5


def test_cancel_cancels_the_task_in_every_rank_and_the_pool_survives(pool, tmp_path):
    pids = pool.pids
    run = pool.run(sleep_until_cancelled, str(tmp_path), background=True)
    assert wait_for(lambda: len([n for n in os.listdir(tmp_path) if n.startswith("running")]) == 2, 60)
    assert run.cancel() is True and run.state == "cancelled"
    with pytest.raises(KeyboardInterrupt, match="pool is still up"):
        run.result()
    assert {"cancelled-0", "cancelled-1"} <= set(os.listdir(tmp_path))
    assert pool.alive and pool.pids == pids and pool.run(lambda: 6) == 6


def test_a_run_on_a_pool_held_by_a_background_run_is_refused_naming_it(pool, tmp_path):
    run = pool.run(sleep_until_cancelled, str(tmp_path), background=True)
    started = time.monotonic()
    with pytest.raises(RunBusyError) as refused:
        pool.run(lambda: 1)  # used to wait, silently, until the other run ended
    assert time.monotonic() - started < 5
    assert refused.value.run_id == run.id and refused.value.resources == (pool_resource(pool),)
    assert f"background run {run.id} (sleep_until_cancelled)" in str(refused.value)
    with pytest.raises(RunBusyError):
        pool.run(lambda: 1, background=True)
    assert run.cancel() and pool.run(lambda: 8) == 8


def test_closing_a_pool_cancels_its_background_run_first(tmp_path):
    with WorkerPool(num_processes=2, use_cpu=True, grace=1.0) as closing:
        run = closing.run(sleep_until_cancelled, str(tmp_path), background=True)
        assert wait_for(lambda: len([n for n in os.listdir(tmp_path) if n.startswith("running")]) == 2, 60)
    assert run.state == "cancelled" and not closing.alive
    assert {"cancelled-0", "cancelled-1"} <= set(os.listdir(tmp_path))  # stopped as an interrupt stops a task
