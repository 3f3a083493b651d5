"""A launch from a process that is itself a rank of an outer job is its own job, and honours its ``timeout``.

The outer job's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_PORT``, ...: a kernel started under
torchrun, a launch inside a pool rank or a launched function) never reach the inner job's ranks,
nor does the outer job's process group a fork would copy; the outer job (a pool) lives on.
"""

from __future__ import annotations

import os
import socket

import pytest

from nbaccel import WorkerPool, notebook_launcher
from nbaccel.launch.pool.warm import close_warm_rank
from tests.launch.procs import children


def _what_the_rank_sees() -> tuple:
    import os

    import torch.distributed as dist

    return os.environ.get("RANK"), os.environ.get("WORLD_SIZE"), os.environ.get("MASTER_PORT"), dist.is_initialized()


@pytest.mark.parametrize("how", ["warm", "fresh", "spawn"])
def test_a_one_process_launch_under_an_outer_jobs_variables_is_its_own_job(monkeypatch, how):
    with socket.socket() as outer_store:  # the outer job's rendezvous: listening, never answering
        outer_store.bind(("127.0.0.1", 0))
        outer_store.listen()
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("LOCAL_RANK", "1")
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(outer_store.getsockname()[1]))
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "outer")
        close_warm_rank()  # a warm rank kept from an earlier test would hide what a new one inherits
        try:  # before: it joined the outer job, blocked past its timeout, then failed after 300 s
            result = notebook_launcher(_what_the_rank_sees, num_processes=1, timeout=240, fresh=how == "fresh",
                                       start_method="spawn" if how == "spawn" else None)
        finally:
            close_warm_rank()
    assert result == (None, None, None, False)
    assert children() == []


def _inner_job_world() -> tuple[int, float, str]:
    import os

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")  # its own default group: the outer one is not inherited
    total = torch.ones(1)
    dist.all_reduce(total)
    return dist.get_world_size(), total.item(), os.environ["MASTER_PORT"]


def _launches_inside(n: int) -> object:
    import os

    from nbaccel import notebook_launcher

    outer_port = os.environ["MASTER_PORT"]
    target = _what_the_rank_sees if n == 1 else _inner_job_world
    inner = notebook_launcher(target, num_processes=n, timeout=240, return_all=True)
    return outer_port, inner


def test_a_launch_inside_a_pool_rank_is_its_own_job_and_the_pool_lives():
    # The caller keeps a warm rank: the pool's ranks, forked from it, must start their own, never use the caller's.
    notebook_launcher(_what_the_rank_sees, num_processes=1)
    with WorkerPool(num_processes=2, use_cpu=True) as pool:
        alone = pool.run(_launches_inside, 1, return_all=True)
        assert ({rank: inner for rank, (_, inner) in alone.items()}
                == {r: {0: (None, None, None, False)} for r in (0, 1)})
        pair = pool.run(_launches_inside, 2, return_all=True)
        for outer_port, inner in pair.values():
            assert [world for world, _, _ in inner.values()] == [2, 2]
            assert [total for _, total, _ in inner.values()] == [2.0, 2.0]  # 2 ranks, not the pool's 2 + 2
            assert all(port != outer_port for _, _, port in inner.values())
        assert pool.alive
        assert pool.run(_pool_world, return_all=True) == {0: (2, 2.0), 1: (2, 2.0)}  # its own group still works
    assert notebook_launcher(_what_the_rank_sees, num_processes=1) == (None, None, None, False)  # the caller's too
    close_warm_rank()
    assert children() == []


def _pool_world() -> tuple[int, float]:
    import torch
    import torch.distributed as dist

    total = torch.ones(1)
    dist.all_reduce(total)
    return dist.get_world_size(), total.item()


def _outer_rank() -> tuple:
    import torch
    import torch.distributed as dist

    from nbaccel import notebook_launcher

    dist.init_process_group("gloo")
    inner = notebook_launcher(_inner_job_world, num_processes=2, timeout=240, return_all=True)
    total = torch.ones(1)
    dist.all_reduce(total)  # the outer group is intact after the inner job
    return inner[0][:2], total.item()


def test_a_launch_inside_a_launched_function_is_its_own_job():
    results = notebook_launcher(_outer_rank, num_processes=2, timeout=300, return_all=True)
    assert results == {0: ((2, 2.0), 2.0), 1: ((2, 2.0), 2.0)}
    assert children() == []
    assert os.environ.get("RANK") is None
