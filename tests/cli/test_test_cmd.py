"""`nbaccel test`: the sanity run says plainly whether distributed runs work here."""

from __future__ import annotations

import pytest

from nbaccel import notebook_launcher
from tests.cli.helpers import env_with, nbaccel


def test_the_check_works_with_the_written_config():
    assert nbaccel("config", "--default").returncode == 0
    result = nbaccel("test", "--num_processes", "2", "--mixed_precision", "bf16")
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        said = f"[rank{rank}]: rank {rank}/2 on cpu (gloo): process group, all_reduce and a DDP step work"
        assert said in result.stdout
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("nbaccel test: works. 2 process(es) on 1 machine(s), cpu over gloo, MULTI_CPU, "
                           "mixed_precision=bf16")


def test_a_broken_setup_is_reported_as_failed():
    """gloo cannot bind to a network interface that does not exist: every rank fails to join."""
    result = nbaccel("test", "--num_processes", "2", env=env_with(GLOO_SOCKET_IFNAME="nbaccel_no_such_if"))
    assert result.returncode == 1
    assert "nbaccel test: traceback of rank" in result.stderr and "Traceback (most recent call last)" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("nbaccel test: FAILED: see the root cause above.")


def test_a_check_that_does_not_finish_in_time_is_reported_as_failed(tmp_path):
    result = nbaccel("test", "--num_processes", "2", "--timeout", "0.01")  # far below the check's own time
    assert result.returncode == 1
    assert "nbaccel test: FAILED: the check did not finish (timeout)." in result.stderr


def _check_with_a_no_op_all_reduce():
    import torch.distributed as dist

    from nbaccel.cli.test_cmd import sanity_check

    dist.all_reduce = lambda *args, **kwargs: None  # a collective that silently does nothing
    return sanity_check()


def _check_with_a_ddp_that_does_not_average():
    import torch

    from nbaccel.cli.test_cmd import sanity_check

    torch.nn.parallel.DistributedDataParallel = lambda module, **kwargs: module  # gradients stay per rank
    return sanity_check()


def test_the_check_catches_a_collective_that_gives_wrong_results():
    with pytest.raises(RuntimeError, match=r"all_reduce gave 1.0 on rank 0, expected 3.0"):
        notebook_launcher(_check_with_a_no_op_all_reduce, num_processes=2)
    with pytest.raises(RuntimeError, match=r"after one DDP step the ranks' weights differ by .*not averaged"):
        notebook_launcher(_check_with_a_ddp_that_does_not_average, num_processes=2)
