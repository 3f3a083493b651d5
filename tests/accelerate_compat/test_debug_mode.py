"""Debug mode as in Accelerate: ``PartialState().debug = True`` or ``ACCELERATE_DEBUG_MODE=1`` checks shapes in
collectives."""

from __future__ import annotations

import importlib

import pytest
import torch

from tests.training.helpers import launch

pytest.importorskip("accelerate")


def mismatched(library: str, set_flag: bool) -> dict:
    lib = importlib.import_module(library)
    utils = importlib.import_module(f"{library}.utils")
    ops = importlib.import_module("accelerate.utils.operations" if library == "accelerate" else "nbaccel.utils")
    if library == "accelerate":
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
    state = lib.PartialState(cpu=True)
    if set_flag:
        state.debug = True
    tensor = torch.ones(2 + state.process_index)
    seen = {"debug": bool(lib.PartialState().debug)}
    for name in ("gather", "reduce", "broadcast"):
        try:
            getattr(utils, name)(tensor)
            seen[name] = "ok"
        except ops.DistributedOperationException:
            seen[name] = "DistributedOperationException"
        except RuntimeError:  # gloo's own error, without the check
            seen[name] = "RuntimeError"
        state.wait_for_everyone()
    return seen


@pytest.mark.parametrize("how", ["attribute", "environment"])
def test_debug_mode_raises_distributed_operation_exception_on_shape_mismatch(how, monkeypatch):
    if how == "environment":
        monkeypatch.setenv("ACCELERATE_DEBUG_MODE", "1")
    ours = launch(mismatched, 2, "nbaccel", how == "attribute")
    theirs = launch(mismatched, 2, "accelerate", how == "attribute")
    assert ours == theirs
    expected = {"debug": True, "gather": "DistributedOperationException", "reduce": "DistributedOperationException",
                "broadcast": "DistributedOperationException"}
    assert ours[0] == ours[1] == expected


def test_without_debug_mode_nothing_is_checked():
    ours = launch(lambda: __import__("nbaccel").PartialState(cpu=True).debug, 2)
    assert ours == {0: False, 1: False}
