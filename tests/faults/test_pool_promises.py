"""A warm pool keeps a launch's promises: one run at a time, only the values asked for, nothing left behind.

Rows of issue 27's table: two threads calling ``pool.run`` at once, ``run`` without ``return_all``
unpickling every rank's value, a pool made in a short-lived thread, and the pool's owner SIGKILLed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from nbaccel import WorkerPool
from nbaccel.errors import PayloadPicklingError, WorkerPoolError
from tests.launch.procs import alive
from tests.pool.helpers import LoadsNowhere, wait_for


def _tagged(tag: int, step: int) -> tuple[int, int, int]:
    time.sleep(0.05 * ((tag + step) % 3))  # the callers' runs interleave every way
    return tag, step, int(os.environ["RANK"])


def test_two_threads_running_at_once_each_get_their_own_results():
    got: dict[int, list] = {}
    errors: list[BaseException] = []

    def caller(tag: int) -> None:
        try:
            got[tag] = [pool.run(_tagged, tag, step, return_all=True) for step in range(5)]
        except BaseException as exc:  # noqa: BLE001 - reported below, not lost in the thread
            errors.append(exc)

    with WorkerPool(num_processes=2, use_cpu=True) as pool:
        threads = [threading.Thread(target=caller, args=(tag,)) for tag in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        assert pool.alive
    assert errors == []
    assert got == {tag: [{0: (tag, step, 0), 1: (tag, step, 1)} for step in range(5)] for tag in range(3)}


class _RunsFromInside:
    """An observer that (wrongly) starts another run of the same pool when the run starts."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool, self.error = pool, None

    def on_launch(self, ranks, start_method):
        try:
            self.pool.run(os.getpid)
        except WorkerPoolError as exc:
            self.error = exc

    def on_state(self, rank, state): ...
    def on_output(self, rank, stream, line): ...
    def on_end(self, ok): ...


def test_a_run_started_from_inside_a_run_is_refused_not_deadlocked():
    with WorkerPool(num_processes=2, use_cpu=True) as pool:
        observer = _RunsFromInside(pool)
        assert pool.launch(pool.request(int, ("7",), observer=observer)) == {0: 7}
        assert observer.error is not None and observer.error.reason == "nested run"
        assert pool.run(int, "8") == 8  # and the pool still works


def _rank1_returns(value_kind: str) -> object:
    if os.environ["RANK"] == "0":
        return "rank 0's value"
    return threading.Lock() if value_kind == "lock" else LoadsNowhere()


def test_only_rank_0s_value_is_read_without_return_all():
    with WorkerPool(num_processes=2, use_cpu=True) as pool:
        assert pool.run(_rank1_returns, "lock") == "rank 0's value"  # never pickled in rank 1
        assert pool.run(_rank1_returns, "unloadable") == "rank 0's value"  # never unpickled here
        assert pool.launch(pool.request(_rank1_returns, ("lock",))) == {0: "rank 0's value"}
        with pytest.raises(PayloadPicklingError, match="rank 1 returned a lock"):
            pool.run(_rank1_returns, "lock", return_all=True)  # asked for: the failure is rank 1's
        assert pool.run(_rank1_returns, "lock") == "rank 0's value"


def test_a_pool_made_in_a_short_lived_thread_outlives_the_thread():
    made: list[WorkerPool] = []
    maker = threading.Thread(target=lambda: made.append(WorkerPool(num_processes=2, use_cpu=True)))
    maker.start()
    maker.join(timeout=300)
    pool = made[0]
    try:
        pids = pool.pids
        time.sleep(1.0)  # a worker killed with its starting thread would be gone by now
        assert all(alive(p) for p in pids) and pool.alive
        assert sorted(pool.run(os.getpid, return_all=True).values()) == sorted(pids)
    finally:
        pool.close()
    assert not any(alive(p) for p in pids)


def test_a_worker_killed_while_idle_is_named_with_its_signal():
    pool = WorkerPool(num_processes=2, use_cpu=True)
    try:
        os.kill(pool.pids[1], signal.SIGKILL)
        assert wait_for(lambda: not pool.alive, 30)
        with pytest.raises(WorkerPoolError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL while idle") as info:
            pool.run(os.getpid)
        assert info.value.state == "dead" and "OOM killer" in str(info.value)
    finally:
        pool.close()


_OWNER = """
    import os, subprocess, sys, time
    from nbaccel import WorkerPool

    def start_sleeper():
        return subprocess.Popen(["sleep", "300"]).pid

    pool = WorkerPool(num_processes=2, use_cpu=True, start_method=sys.argv[1])
    print("WORKERS", *pool.pids, flush=True)
    print("SLEEPERS", *pool.run(start_sleeper, return_all=True).values(), flush=True)
    time.sleep(300)
"""


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_sigkilled_owner_leaves_no_worker_no_worker_child_and_no_folder(tmp_path, start_method):
    script = tmp_path / "owner.py"
    script.write_text(textwrap.dedent(_OWNER))
    temp = tmp_path / "tmp"  # the owner's own temp folder: other processes' pools are not counted
    temp.mkdir()
    owner = subprocess.Popen([sys.executable, str(script), start_method], stdout=subprocess.PIPE, text=True,
                             start_new_session=True,
                             env={**os.environ, "TMPDIR": str(temp),
                                  "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    pids: dict[str, list[int]] = {}
    for line in owner.stdout:  # type: ignore[union-attr]  # stdout=PIPE: never None
        name, *numbers = line.split()
        pids[name] = [int(n) for n in numbers]
        if name == "SLEEPERS":
            break
    assert len(pids.get("SLEEPERS", [])) == 2, "the owner did not start its pool"
    assert [p.name[:12] for p in temp.iterdir()] == ["nbaccel-pool"]
    owner.kill()
    owner.wait()
    everything = pids["WORKERS"] + pids["SLEEPERS"]
    assert wait_for(lambda: not any(alive(p) for p in everything), 30), [p for p in everything if alive(p)]
    assert wait_for(lambda: not any(temp.iterdir()), 30), list(temp.iterdir())


def test_the_reaper_refuses_a_folder_path_it_could_not_read_back():
    from nbaccel.launch.reaper import group_reaper

    with pytest.raises(ValueError, match="holds a newline") as info:
        group_reaper().watch_folder("/tmp/two\nlines")
    assert "Fix:" in str(info.value)
