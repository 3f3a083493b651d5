"""`WorkerPool(backend="ray")`: warm rank actors on the two-node cluster (see conftest.py)."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from nbaccel import WorkerPool
from nbaccel.errors import WorkerPoolError
from tests.ray.conftest import live_actors, wait_until_clean

pytestmark = pytest.mark.usefixtures("ray_cluster")


def load_state() -> int:
    import torch

    from nbaccel import Accelerator
    from nbaccel.launch.pool.serve import worker_namespace

    accelerator = Accelerator()
    worker_namespace()["table"] = torch.full((3,), float(accelerator.process_index))
    return accelerator.num_processes


def use_state() -> float:
    import torch.distributed as dist

    from nbaccel.launch.pool.serve import worker_namespace

    table = worker_namespace()["table"].clone()
    dist.all_reduce(table)  # the process group joined when the pool started is still there
    return float(table[0])


def fail_on_one() -> None:
    import os

    if os.environ["RANK"] == "1":
        raise KeyError("missing column")


def test_pool_on_ray_keeps_state_between_runs_and_survives_a_failing_run():
    with WorkerPool(4, use_cpu=True, backend="ray") as pool:
        assert pool.start_method == "ray"
        assert len(live_actors()) == 4
        pids = pool.pids
        assert pool.run(load_state) == 4
        assert pool.run(use_state, return_all=True) == {0: 6.0, 1: 6.0, 2: 6.0, 3: 6.0}  # 0 + 1 + 2 + 3
        with pytest.raises(KeyError, match="missing column"):
            pool.run(fail_on_one)
        assert pool.alive
        assert pool.run(use_state) == 6.0  # the state outlived the failed run
        assert pool.pids == pids
        workers = pool.workers()
        assert [w.rank for w in workers] == [0, 1, 2, 3]
        assert all(w.alive and w.device == "cpu" and (w.memory_bytes or 0) > 0 for w in workers)
    assert wait_until_clean() == ([], [])
    with pytest.raises(WorkerPoolError, match="closed"):
        pool.run(use_state)


def test_interrupting_a_pool_run_cancels_it_and_keeps_the_pool():
    def sleepy() -> None:  # a training loop's shape: Python code between short native calls
        import time

        for _ in range(600):
            time.sleep(0.1)

    with WorkerPool(2, use_cpu=True, backend="ray") as pool:
        main = threading.get_ident()
        threading.Timer(4.0, signal.pthread_kill, (main, signal.SIGINT)).start()
        began = time.monotonic()
        with pytest.raises(KeyboardInterrupt, match="the pool is still up"):  # the words of every backend
            pool.run(sleepy)
        assert time.monotonic() - began < 30
        assert pool.alive
        assert pool.run(lambda: "still here") == "still here"
    assert wait_until_clean() == ([], [])


def test_a_rank_stuck_in_native_code_is_killed_and_the_pool_is_dead():
    def stuck_in_barrier() -> None:
        import os

        import torch.distributed as dist

        if os.environ["RANK"] == "0":
            raise RuntimeError("rank 0 gave up")
        dist.barrier()  # never returns: rank 0 will not join; an interrupt cannot reach native code

    with WorkerPool(2, use_cpu=True, backend="ray", grace=1.0) as pool:
        pool.run(load_state)
        with pytest.raises(RuntimeError, match="rank 0 gave up") as info:
            pool.run(stuck_in_barrier)
        assert "the WorkerPool is dead" in "\n".join(info.value.__notes__)
        assert not pool.alive
        with pytest.raises(WorkerPoolError, match="dead"):
            pool.run(use_state)
        pool.restart()
        assert pool.alive and pool.run(lambda: 5) == 5
    assert wait_until_clean() == ([], [])
