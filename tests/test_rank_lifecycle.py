"""What a rank forgets when it starts afresh, and how a warm rank joins its group (nbaccel.rank_lifecycle).

The lifecycle object travels with the request to every rank side; these tests make the state, start
afresh as every backend does, and check what a user would see, in this process and in real launches.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import nbaccel
from nbaccel import process_state
from nbaccel.identity import WorkerIdentity, current_identity, rank_generation, set_identity
from nbaccel.launch import run_log
from nbaccel.rank_lifecycle import RankLifecycle

_RANK_1_OF_2 = WorkerIdentity(rank=1, local_rank=1, world_size=2, local_world_size=2, node_rank=0)


@pytest.fixture
def fresh_state(monkeypatch):
    """This test's own process state, identity and run history; the suite's are back afterwards."""
    monkeypatch.setattr(process_state, "_shared", {})
    monkeypatch.setattr(run_log, "_last", None)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NBACCEL_MIXED_PRECISION",
                 "ACCELERATE_MIXED_PRECISION", "NBACCEL_USE_CPU"):
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch
    set_identity(None)


def _python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_an_accelerator_made_after_a_fresh_start_reads_the_new_environment(fresh_state):
    assert nbaccel.Accelerator().state.mixed_precision == "no"
    fresh_state.setenv("NBACCEL_MIXED_PRECISION", "bf16")
    assert nbaccel.Accelerator().state.mixed_precision == "no"  # one state per process: the first one's
    RankLifecycle().start_afresh()
    assert nbaccel.Accelerator().state.mixed_precision == "bf16"


def test_a_state_object_kept_from_before_is_emptied_not_replaced(fresh_state):
    kept = nbaccel.ProcessState()
    assert process_state.is_initialized()
    RankLifecycle().start_afresh()
    assert not process_state.is_initialized()
    assert "device" not in kept.__dict__  # the old object shares the (now empty) state, as after _reset_state()


def test_a_fresh_start_forgets_the_identity_a_launcher_set(fresh_state):
    set_identity(_RANK_1_OF_2)
    set_identity(_RANK_1_OF_2, thread=True)
    assert current_identity() == _RANK_1_OF_2
    before = rank_generation()
    RankLifecycle().start_afresh()
    assert current_identity() is None
    assert rank_generation() == before + 1


def test_starting_afresh_needs_no_process_state_import():
    code = ("import sys; from nbaccel.identity import WorkerIdentity, current_identity, set_identity;"
            "from nbaccel.rank_lifecycle import RankLifecycle;"
            "set_identity(WorkerIdentity(rank=1, local_rank=1, world_size=2, local_world_size=2, node_rank=0));"
            "RankLifecycle().start_afresh(); print(current_identity(), 'nbaccel.process_state' in sys.modules)")
    assert _python(code) == "None False"


def test_a_fresh_start_forgets_the_notebooks_run_history(fresh_state):
    run_log.begin_run_log().add(0, {"items": [{"step": 0, "time": 0.0, "loss": 1.0}]})
    assert [r["loss"] for r in nbaccel.last_run_history()] == [1.0]
    RankLifecycle().start_afresh()
    assert nbaccel.last_run_history() == []


def test_a_pool_rank_does_not_see_the_notebooks_run_history(fresh_state):
    run_log.begin_run_log().add(0, {"items": [{"step": 0, "time": 0.0, "loss": 1.0}]})
    with nbaccel.WorkerPool(num_processes=1, use_cpu=True, grace=1.0) as pool:
        assert pool.run(nbaccel.last_run_history) == []


def test_requests_carry_nbaccels_lifecycle_unless_given_one():
    request = nbaccel.launch.build_request(print, num_processes=2, use_cpu=True)
    assert type(request.lifecycle) is RankLifecycle
    assert nbaccel.launch.build_request(print, num_processes=2, use_cpu=True, lifecycle=_Marking()).lifecycle == \
        _Marking()


# --------------------------------------------------------------------------- a lifecycle of the caller's


class _Marking(RankLifecycle):
    """Sets a variable when the rank starts afresh, and says so when the warm rank joins its group."""

    def start_afresh(self) -> None:
        super().start_afresh()
        import os

        os.environ["NBACCEL_TEST_LIFECYCLE"] = "fresh"

    def join_group(self) -> str:
        import os

        os.environ["NBACCEL_TEST_JOINED"] = "yes"
        return super().join_group()


def _seen() -> tuple[str | None, str | None]:
    import os

    return os.environ.get("NBACCEL_TEST_LIFECYCLE"), os.environ.get("NBACCEL_TEST_JOINED")


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_each_fresh_rank_starts_afresh_through_the_callers_lifecycle(start_method):
    seen = nbaccel.notebook_launcher(_seen, num_processes=2, use_cpu=True, start_method=start_method,
                                     return_all=True, lifecycle=_Marking())
    assert seen == {0: ("fresh", None), 1: ("fresh", None)}


def test_a_one_process_launch_on_the_warm_rank_uses_the_lifecycle_too():
    assert nbaccel.notebook_launcher(_seen, num_processes=1, use_cpu=True, lifecycle=_Marking()) == ("fresh", None)


def test_a_pools_ranks_join_their_group_through_the_lifecycle():
    with nbaccel.WorkerPool(num_processes=2, use_cpu=True, grace=1.0, lifecycle=_Marking()) as pool:
        assert pool.run(_seen, return_all=True) == {0: ("fresh", "yes"), 1: ("fresh", "yes")}


# --------------------------------------------------------------------------- the group join


def test_a_warm_join_chooses_what_the_process_state_would():
    code = ("from nbaccel.rank_lifecycle import RankLifecycle; device = RankLifecycle().join_group();"
            "from nbaccel.process_state import ProcessState;"
            "print(device == str(ProcessState().device), ProcessState().backend in ('gloo', 'cuda:nccl,cpu:gloo'))")
    assert _python(code) == "True True"


def test_a_pools_ranks_share_one_group_joined_before_any_task():
    def world() -> tuple[bool, int, str]:
        import torch.distributed as dist

        return dist.is_initialized(), dist.get_world_size(), dist.get_backend()

    with nbaccel.WorkerPool(num_processes=2, use_cpu=True, grace=1.0) as pool:
        assert pool.run(world, return_all=True) == {0: (True, 2, "gloo"), 1: (True, 2, "gloo")}
