"""A rank that held a pool or a warm rank leaves no ``nbaccel-pool-*`` folder, however it is stopped.

Row of issue 33: a launch's rank that started a ``WorkerPool`` or a warm one-process launch of its
own, then was stopped by the launch's timeout, left the pool's socket folder behind (the rank ends
everything it started, its group reaper included, before that reaper could remove the folder).
"""

from __future__ import annotations

import os
import tempfile
import time

import pytest

from nbaccel import WorkerPool, notebook_launcher
from tests.pool.helpers import wait_for
from tests.timed_out_launch import stop_at_a_timeout


def _holds_ranks_then_hangs(kind: str, ready: str) -> None:
    if kind == "pool":
        pool = WorkerPool(num_processes=1, use_cpu=True)
        pool.run(os.getpid)
    else:
        notebook_launcher(os.getpid, num_processes=1, use_cpu=True)  # a warm rank kept by this rank
    open(ready, "w").close()
    time.sleep(300)


def _holds_ranks_and_returns(kind: str) -> int:
    if kind == "pool":
        pool = WorkerPool(num_processes=1, use_cpu=True)
        globals()["kept"] = pool  # still held when the rank ends
        return pool.pids[0]
    return notebook_launcher(os.getpid, num_processes=1, use_cpu=True)


def _pool_folders(root: str) -> list[str]:
    return [name for name in os.listdir(root) if name.startswith("nbaccel-pool-")]


@pytest.mark.parametrize("kind", ["pool", "warm"])
def test_a_rank_stopped_by_timeout_removes_the_folder_of_the_ranks_it_held(tmp_path, monkeypatch, kind):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the forked rank makes its folder here
    ready = tmp_path / "ready"
    stop_at_a_timeout(lambda timeout: notebook_launcher(_holds_ranks_then_hangs, (kind, str(ready)), num_processes=1,
                                                        use_cpu=True, fresh=True, timeout=timeout),
                      got_there=ready.exists)  # the rank started its own ranks
    assert wait_for(lambda: not _pool_folders(str(tmp_path)), 10), _pool_folders(str(tmp_path))


@pytest.mark.parametrize("kind", ["pool", "warm"])
def test_a_rank_that_returns_holding_ranks_removes_their_folder(tmp_path, monkeypatch, kind):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    inner = notebook_launcher(_holds_ranks_and_returns, (kind,), num_processes=1, use_cpu=True, fresh=True,
                              timeout=120)
    assert inner > 0
    assert wait_for(lambda: not _pool_folders(str(tmp_path)), 10), _pool_folders(str(tmp_path))
