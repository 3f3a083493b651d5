"""One worker identity: set once per worker or replica thread, read by the state, the cell program and ops."""

from __future__ import annotations

import sys
import threading
import types

from nbaccel import notebook_launcher
from nbaccel.identity import (
    WorkerIdentity,
    clear_identity,
    current_identity,
    set_identity,
)
from nbaccel.magics.cell import CellProgram, run_cell_program


def _who():
    from nbaccel.state import ProcessState

    state = ProcessState()
    return current_identity(), (state.process_index, state.num_processes, state.local_process_index)


def test_every_worker_knows_its_identity_and_the_state_agrees():
    got = notebook_launcher(_who, num_processes=2, return_all=True)
    for rank in (0, 1):
        identity, state = got[rank]
        assert identity == WorkerIdentity(rank=rank, local_rank=rank, world_size=2, local_world_size=2)
        assert state == (rank, 2, rank)


def test_a_worker_does_not_inherit_its_parents_identity():
    set_identity(WorkerIdentity(rank=5, world_size=9))
    try:
        assert notebook_launcher(current_identity, num_processes=1) is None  # a lone worker: no job
    finally:
        clear_identity()
    assert current_identity() is None


def _in_threads(function, world: int) -> dict[int, object]:
    """Run ``function`` in ``world`` threads of this process, each with its own identity (as XLA replicas do)."""
    out: dict[int, object] = {}

    def replica(rank: int) -> None:
        set_identity(WorkerIdentity(rank=rank, local_rank=rank, world_size=world, local_world_size=world,
                                    shares_process=True), thread=True)
        try:
            out[rank] = function()
        finally:
            set_identity(None, thread=True)

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return out


def test_replica_threads_sharing_a_process_each_see_their_own_rank():
    got = _in_threads(lambda: current_identity().rank, 3)
    assert got == {0: 0, 1: 1, 2: 2}
    assert current_identity() is None  # the calling thread was never a replica


def test_a_cell_program_in_replica_threads_returns_only_from_rank_0():
    # Before: the cell program read RANK from the shared environment, so every replica thread was rank 0.
    program = CellProgram("x = 2\nx * 21", filename="<identity-test>", first_line=2,
                          cell_lines=["%%accel_launch\n", "x = 2\n", "x * 21\n"], user_ns={})
    got = _in_threads(lambda: run_cell_program(program), 2)
    assert got[0].value == 42 and got[1] is None


def test_collectives_count_replica_threads_from_their_identity(monkeypatch):
    from nbaccel import ops

    monkeypatch.setitem(sys.modules, "torch_xla", types.ModuleType("torch_xla"))  # XLA replicas: no gloo group
    assert _in_threads(ops._world, 4) == {r: 4 for r in range(4)}
