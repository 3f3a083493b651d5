"""A rank that dies without raising is the root cause, every time; its peers' collective errors are consequences."""

from __future__ import annotations

import signal

import pytest

from nbaccel import ProcessExitedError, WorkerFailedError, notebook_launcher
from nbaccel.launch.failures import WorkerFailure, format_report
from tests.launch.procs import children


def _dies_in_a_collective(how: str) -> None:
    import ctypes
    import os
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    if dist.get_rank() == 1:
        time.sleep(0.2)  # the peers are inside all_reduce, waiting for this rank
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif how == "exit":
            os._exit(3)
        else:
            ctypes.string_at(0)  # segfault
    for _ in range(1000):
        dist.all_reduce(torch.ones(1))


CASES = [("sigkill", 4)] * 4 + [("sigkill", 2)] * 3 + [("exit", 4)] * 2 + [("segfault", 4)] * 2


@pytest.mark.parametrize(("how", "n"), CASES, ids=[f"{h}-{n}procs-{i}" for i, (h, n) in enumerate(CASES)])
def test_the_rank_that_died_is_the_root_cause_not_its_peers_connection_errors(how, n):
    with pytest.raises(ProcessExitedError) as info:
        notebook_launcher(_dies_in_a_collective, args=(how,), num_processes=n)
    root = info.value.failures[0]
    assert root.rank == 1, format_report(info.value.failures)
    if how == "exit":
        assert root.exitcode == 3
    else:
        assert root.signal == (signal.SIGKILL if how == "sigkill" else signal.SIGSEGV)
    assert str(info.value).startswith("root cause: rank 1")
    assert children() == []


def test_peer_loss_errors_rank_after_the_failure_that_caused_them():
    killed = WorkerFailure(rank=2, pid=12, time=10.5, signal=signal.SIGKILL)
    reset = WorkerFailure(rank=0, pid=10, time=10.1, exc_type="RuntimeError",
                          message="[gloo/transport/tcp/pair.cc:534] Connection reset by peer [127.0.0.1]:4242")
    assert format_report([reset, killed]).startswith("root cause: rank 2 (pid 12) was killed by signal SIGKILL")
    # With no other failure known, the connection error is all there is: it stays the root cause.
    assert format_report([reset]).startswith("root cause: rank 0 (pid 10) raised RuntimeError")
    # A real exception raised first still wins over a later exit.
    bug = WorkerFailure(rank=3, pid=13, time=10.0, exc_type="ValueError", message="bad batch")
    assert format_report([killed, reset, bug]).startswith("root cause: rank 3 (pid 13) raised ValueError")


def test_the_family_is_catchable_as_worker_failed_error():
    with pytest.raises(WorkerFailedError):
        notebook_launcher(_dies_in_a_collective, args=("exit",), num_processes=2)
