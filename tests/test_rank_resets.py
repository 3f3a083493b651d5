"""What a rank forgets when it starts afresh, and how a warm rank joins its group (nbaccel.rank_resets).

Each module that keeps per-process state registers its reset when imported; these tests make the
state, run :func:`reset_rank_state` as every backend does, and check what a user would see.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import nbaccel
from nbaccel import process_state, rank_resets
from nbaccel.identity import WorkerIdentity, current_identity, set_identity
from nbaccel.rank_resets import join_rank_group, reset_rank_state
from nbaccel.launch import run_log

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


def test_an_accelerator_made_after_a_reset_reads_the_new_environment(fresh_state):
    assert nbaccel.Accelerator().state.mixed_precision == "no"
    fresh_state.setenv("NBACCEL_MIXED_PRECISION", "bf16")
    assert nbaccel.Accelerator().state.mixed_precision == "no"  # one state per process: the first one's
    reset_rank_state()
    assert nbaccel.Accelerator().state.mixed_precision == "bf16"


def test_a_reset_forgets_the_identity_a_launcher_set(fresh_state):
    set_identity(_RANK_1_OF_2)
    set_identity(_RANK_1_OF_2, thread=True)
    assert current_identity() == _RANK_1_OF_2
    reset_rank_state()
    assert current_identity() is None


def test_the_identity_registers_its_reset_when_imported_alone():
    code = ("import sys; from nbaccel.identity import WorkerIdentity, current_identity, set_identity;"
            "from nbaccel.rank_resets import reset_rank_state;"
            "set_identity(WorkerIdentity(rank=1, local_rank=1, world_size=2, local_world_size=2, node_rank=0));"
            "reset_rank_state(); print(current_identity(), 'nbaccel.process_state' in sys.modules)")
    assert _python(code) == "None False"


def test_a_reset_forgets_the_notebooks_run_history(fresh_state):
    run_log.begin_run_log().add(0, {"items": [{"step": 0, "time": 0.0, "loss": 1.0}]})
    assert [r["loss"] for r in nbaccel.last_run_history()] == [1.0]
    reset_rank_state()
    assert nbaccel.last_run_history() == []


def test_a_pool_rank_does_not_see_the_notebooks_run_history(fresh_state):
    run_log.begin_run_log().add(0, {"items": [{"step": 0, "time": 0.0, "loss": 1.0}]})
    with nbaccel.WorkerPool(num_processes=1, use_cpu=True, grace=1.0) as pool:
        assert pool.run(nbaccel.last_run_history) == []


# --------------------------------------------------------------------------- the group join


def test_a_rank_that_never_imported_the_state_joins_through_the_provider():
    code = ("import sys; from nbaccel.rank_resets import join_rank_group; device = join_rank_group();"
            "from nbaccel.process_state import ProcessState;"
            "print(device == str(ProcessState().device), ProcessState().backend in ('gloo', 'cuda:nccl,cpu:gloo'))")
    assert _python(code) == "True True"


def test_a_provider_without_the_join_is_an_error_naming_it(monkeypatch):
    monkeypatch.setattr(rank_resets, "GROUP_JOIN_PROVIDER", "nbaccel.errors")
    with pytest.raises(RuntimeError, match="'nbaccel.errors' has no join_pool_group"):
        join_rank_group()
