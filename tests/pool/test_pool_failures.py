"""Failures in a warm pool: a user's exception keeps it, a dead worker ends it (clearly), interrupts cancel the task."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from nbaccel import (
    LaunchTimeoutError,
    ProcessExitedError,
    WorkerFailedError,
    WorkerPool,
    WorkerPoolError,
)

from .helpers import pid_and_rank, sleep_until_cancelled, wait_for


def _raise_on_rank_1():
    if os.environ["RANK"] == "1":
        raise KeyError("missing column")
    return "fine"


def test_a_users_exception_is_raised_with_its_rank_and_the_pool_stays(pool):
    pids = pool.pids
    with pytest.raises(KeyError) as info:
        pool.run(_raise_on_rank_1)
    assert isinstance(info.value, WorkerFailedError)
    assert info.value.failures[0].rank == 1 and "missing column" in info.value.failures[0].message
    assert pool.alive and pool.pids == pids
    assert pool.run(pid_and_rank, return_all=True) == {r: (pid, r) for r, pid in enumerate(pids)}


def _interrupt_me_when(marker_dir, count: int) -> threading.Thread:
    def fire():
        if wait_for(lambda: len([n for n in os.listdir(marker_dir) if n.startswith("running")]) >= count, 60):
            os.kill(os.getpid(), signal.SIGINT)
    thread = threading.Thread(target=fire, daemon=True)
    thread.start()
    return thread


def test_an_interrupt_cancels_the_task_in_every_rank_and_keeps_the_pool(pool, tmp_path):
    pids = pool.pids
    pool.run(signal.signal, signal.SIGINT, signal.SIG_IGN)  # an earlier task's handler does not stick
    _interrupt_me_when(tmp_path, 2)
    with pytest.raises(KeyboardInterrupt) as info:
        pool.run(sleep_until_cancelled, str(tmp_path))
    assert "pool is still up" in str(info.value)
    assert {"cancelled-0", "cancelled-1"} <= set(os.listdir(tmp_path))
    assert pool.alive and pool.pids == pids and pool.run(lambda: 5) == 5


def test_a_run_past_the_timeout_is_cancelled_and_the_pool_stays(tmp_path):
    with WorkerPool(num_processes=2, use_cpu=True, timeout=1.0) as timed:
        with pytest.raises(LaunchTimeoutError) as info:
            timed.run(sleep_until_cancelled, str(tmp_path))
        message = str(info.value)
        assert info.value.reason == "timeout" and message.endswith("The pool is still up.")
        assert message.count("cancelled in every rank") == 1, message  # said once, before the stacks
        assert {"cancelled-0", "cancelled-1"} <= set(os.listdir(tmp_path))
        assert timed.alive and timed.run(lambda: 6) == 6


def _ignore_interrupts(marker_dir):
    import time
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    open(os.path.join(marker_dir, f"running-{os.environ['RANK']}"), "w").close()
    time.sleep(60)


def test_ranks_that_ignore_the_interrupt_are_killed_and_the_pool_says_it_is_dead(tmp_path):
    doomed = WorkerPool(num_processes=2, use_cpu=True, grace=0.5)
    pids = doomed.pids
    try:
        _interrupt_me_when(tmp_path, 2)
        with pytest.raises(KeyboardInterrupt) as info:
            doomed.run(_ignore_interrupts, str(tmp_path))
        assert "killed" in str(info.value) and "pool is dead" in str(info.value)
        assert not doomed.alive and not any(os.path.exists(f"/proc/{p}") for p in pids)
        with pytest.raises(WorkerPoolError) as refused:
            doomed.run(int)
        assert refused.value.state == "dead" and "restart" in str(refused.value)
    finally:
        doomed.close()


class _NoNotesError(ValueError):
    """An exception as Python 3.10 has them: no ``add_note`` (3.11+)."""

    def __getattribute__(self, name):
        if name == "add_note":
            raise AttributeError(name)
        return super().__getattribute__(name)


def _rank_1_raises_while_rank_0_waits_in_a_collective(marker_dir, error=ValueError):
    import time

    import torch
    import torch.distributed as dist
    if os.environ["RANK"] == "1":  # rank 0 is in the collective (not merely cancelled before it) when this raises
        while not os.path.exists(os.path.join(marker_dir, "in-collective")):
            time.sleep(0.01)
        time.sleep(0.3)
        raise error("bad shape on rank 1")
    open(os.path.join(marker_dir, "in-collective"), "w").close()
    dist.all_reduce(torch.ones(1))


def test_a_failure_that_leaves_a_rank_stuck_in_a_collective_ends_the_pool(tmp_path):
    stuck = WorkerPool(num_processes=2, use_cpu=True, grace=0.5)
    try:
        with pytest.raises(ValueError) as info:
            stuck.run(_rank_1_raises_while_rank_0_waits_in_a_collective, str(tmp_path))
        assert info.value.failures[0].rank == 1
        assert any("WorkerPool is dead" in note and "restart" in note for note in info.value.__notes__)
        assert not stuck.alive
    finally:
        stuck.close()


def test_the_pool_ends_with_the_users_error_where_exceptions_take_no_notes(tmp_path):
    stuck = WorkerPool(num_processes=2, use_cpu=True, grace=0.5)
    try:
        with pytest.raises(_NoNotesError):  # Python 3.10: not an AttributeError from add_note
            stuck.run(_rank_1_raises_while_rank_0_waits_in_a_collective, str(tmp_path), _NoNotesError)
        assert not stuck.alive
    finally:
        stuck.close()


def _die_on_rank_1():
    import time
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(30)


def test_a_dead_worker_fails_the_run_then_the_pool_refuses_until_restarted():
    broken = WorkerPool(num_processes=2, use_cpu=True)
    old = broken.pids
    try:
        with pytest.raises(ProcessExitedError) as info:
            broken.run(_die_on_rank_1)
        root = info.value.failures[0]
        assert (root.rank, root.signal) == (1, signal.SIGKILL)
        assert not broken.alive and not any(os.path.exists(f"/proc/{p}") for p in old)
        with pytest.raises(WorkerPoolError) as refused:
            broken.run(int)
        assert refused.value.state == "dead" and "rank 1" in refused.value.reason
        broken.restart()
        assert broken.alive and broken.run(lambda: 9) == 9 and set(broken.pids).isdisjoint(old)
    finally:
        broken.close()


def test_a_worker_that_dies_between_runs_is_reported_at_the_next_run():
    idle = WorkerPool(num_processes=2, use_cpu=True)
    try:
        os.kill(idle.pids[0], signal.SIGKILL)
        assert wait_for(lambda: not idle.alive, 10)
        with pytest.raises(WorkerPoolError) as refused:
            idle.run(int)
        assert refused.value.state == "dead" and "rank 0" in refused.value.reason and "idle" in refused.value.reason
    finally:
        idle.close()


def _exit_when_cancelled(marker_dir):
    import time
    open(os.path.join(marker_dir, f"running-{os.environ['RANK']}"), "w").close()
    try:
        time.sleep(60)
    except KeyboardInterrupt:
        if os.environ["RANK"] == "1":
            os._exit(3)
        raise


def test_a_rank_that_dies_while_being_cancelled_ends_the_pool_and_says_so(tmp_path):
    fragile = WorkerPool(num_processes=2, use_cpu=True, grace=2.0)
    try:
        _interrupt_me_when(tmp_path, 2)
        with pytest.raises(KeyboardInterrupt) as info:
            fragile.run(_exit_when_cancelled, str(tmp_path))
        assert "rank 1" in str(info.value) and "exited with code 3" in str(info.value)
        assert "pool is dead" in str(info.value) and not fragile.alive
    finally:
        fragile.close()


def test_an_interrupt_right_after_the_task_is_sent_still_cancels_it(pool, tmp_path, monkeypatch):
    """The interrupt lands between sending the task and watching it (seen under load): the ranks are cancelled,
    not left running a task whose replies the next run would read."""
    from nbaccel.launch.pool import local_ranks

    sent = []
    real_send = local_ranks._send_task

    def send_then_interrupt(member, payload, send_result):
        real_send(member, payload, send_result)
        sent.append(member.rank)
        if len(sent) == pool.num_processes:
            wait_for(lambda: len([n for n in os.listdir(tmp_path) if n.startswith("running")]) == 2, 30)
            os.kill(os.getpid(), signal.SIGINT)  # held until the last frame is out, then raised

    monkeypatch.setattr(local_ranks, "_send_task", send_then_interrupt)
    with pytest.raises(KeyboardInterrupt) as info:
        pool.run(sleep_until_cancelled, str(tmp_path))
    monkeypatch.undo()
    assert "pool is still up" in str(info.value)
    assert {"cancelled-0", "cancelled-1"} <= set(os.listdir(tmp_path))
    assert pool.run(lambda: 7) == 7
