"""A failed launch is caught as Accelerate's is (torch elastic's ``ChildFailedError``); ``join_uneven_inputs``
on models ``Join`` cannot take warns and does nothing, as Accelerate's does. Two CPU processes.
"""

from __future__ import annotations

import importlib
import pickle
import signal
import warnings

import pytest
import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

import nbaccel
from nbaccel.errors import ProcessExitedError, WorkerFailedError
from tests.training.helpers import launch

accelerate = pytest.importorskip("accelerate")


def fails_on_rank_1() -> None:
    import os

    if int(os.environ.get("RANK", "0")) == 1:
        raise KeyError("rank 1 has no data")


def exits_on_rank_1() -> None:
    import os

    if int(os.environ.get("RANK", "0")) == 1:
        os._exit(3)


def caught(library: str, function) -> dict:
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        importlib.import_module(library).notebook_launcher(function, num_processes=2)
    except ChildFailedError as exc:
        rank, _ = exc.get_first_failure()
        return {"caught as": "ChildFailedError", "first rank": rank, "has name": bool(exc.name)}
    finally:  # Accelerate's elastic launch leaves its handlers installed
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return {"caught as": "nothing"}


@pytest.mark.parametrize("function", [fails_on_rank_1, exits_on_rank_1])
def test_a_failed_launch_is_a_child_failed_error_in_both(function):
    assert caught("nbaccel", function) == caught("accelerate", function) == {
        "caught as": "ChildFailedError", "first rank": 1, "has name": True}


def test_nbaccels_failure_keeps_its_own_types_and_fields():
    with pytest.raises(KeyError) as info:
        nbaccel.notebook_launcher(fails_on_rank_1, num_processes=2, use_cpu=True, timeout=120)
    error = info.value
    assert isinstance(error, WorkerFailedError) and isinstance(error, ChildFailedError)
    assert error.failures[0].rank == 1 and error.get_first_failure() == (1, error.failures[0])
    again = pickle.loads(pickle.dumps(error))
    assert isinstance(again, KeyError) and isinstance(again, ChildFailedError)
    assert again.failures == error.failures
    exited = ProcessExitedError("rank 1 exited with code 3")  # made directly, as the pool does
    assert isinstance(exited, ChildFailedError) and type(exited).__name__ == "ProcessExitedError"
    assert isinstance(pickle.loads(pickle.dumps(exited)), (ProcessExitedError, ChildFailedError))


def joined_unprepared(library: str) -> dict:
    lib = importlib.import_module(library)
    if library == "accelerate":
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    accelerator = lib.Accelerator(cpu=True)
    model = torch.nn.Linear(2, 1)  # never prepared: not a DDP model, so not a torch Joinable
    ran = 0
    with warnings.catch_warnings(record=True) as caught_warnings:
        warnings.simplefilter("always")
        with accelerator.join_uneven_inputs([model], even_batches=False):
            for _ in range(1 + accelerator.process_index):  # uneven on purpose; no collectives
                model(torch.ones(1, 2))
                ran += 1
    # Accelerate's test_distributed_data_loop looks for these words
    return {"ran": ran, "warned": any("only supported for multi-GPU" in str(w.message) for w in caught_warnings)}


def test_join_uneven_inputs_on_a_model_join_cannot_take_warns_and_runs_the_block():
    ours, theirs = launch(joined_unprepared, 2, "nbaccel"), launch(joined_unprepared, 2, "accelerate")
    assert ours == theirs == {0: {"ran": 1, "warned": True}, 1: {"ran": 2, "warned": True}}
