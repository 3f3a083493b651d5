"""Nested-data helpers on non-tensor leaves and odd shapes, and debug mode on every collective: as in Accelerate.

One process for ``concatenate``, ``honor_type`` and the leaves ``pad_across_processes`` refuses; two
CPU processes over gloo for padding odd shapes and for debug mode.
"""

from __future__ import annotations

import collections
import importlib
import warnings

import pytest
import torch

from tests.training.helpers import launch

pytest.importorskip("accelerate")

LIBRARIES = ["accelerate", "nbaccel"]
Pair = collections.namedtuple("Pair", "first second")


def outcome(call) -> str:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = repr(call())
        except Exception as exc:  # noqa: BLE001 - the type is what is compared
            result = type(exc).__name__
    return result + "".join(f" +{w.category.__name__}" for w in caught if "Pad" in w.category.__name__)


def one_process(library: str) -> dict:
    u = importlib.import_module(f"{library}.utils")
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    return {
        "pad a str leaf": outcome(lambda: u.pad_across_processes({"a": torch.ones(2), "s": "text"})),
        "pad an int leaf": outcome(lambda: u.pad_across_processes([torch.ones(2), 3])),
        "pad 0-d": outcome(lambda: u.pad_across_processes(torch.tensor(1.0))),
        "pad dim out of range": outcome(lambda: u.pad_across_processes(torch.ones(2, 3), dim=5)),
        "pad a namedtuple": outcome(lambda: u.pad_across_processes(Pair(torch.ones(2), torch.zeros(1)))),
        "pad nested": outcome(lambda: u.pad_across_processes(nested) is nested),
        "cat namedtuples": outcome(lambda: u.concatenate([Pair(torch.ones(1), torch.zeros(1)),
                                                          Pair(torch.ones(2), torch.zeros(2))])),
        "cat one str": outcome(lambda: u.concatenate(["a"])),
        "cat two strs": outcome(lambda: u.concatenate(["a", "b"])),
        "cat empty rows": outcome(lambda: u.concatenate([torch.ones(0, 2), torch.ones(1, 2)])),
        "honor a namedtuple": outcome(lambda: u.honor_type(Pair(1, 2), iter([3, 4]))),
        "honor a list": outcome(lambda: u.honor_type([1], iter([2, 3]))),
    }


def test_one_process_helpers_match():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's nested-tensor prototype warning, once
        torch.nested.nested_tensor([torch.ones(1)])
    theirs, ours = (one_process(lib) for lib in LIBRARIES)
    assert ours == theirs
    assert ours["pad a str leaf"] == ours["pad an int leaf"] == "TypeError"
    assert ours["pad nested"] == "True +CannotPadNestedTensorWarning"
    assert ours["cat one str"] == "'a'" and ours["cat namedtuples"].startswith("Pair(first=tensor([1., 1., 1.])")


def _fresh(library: str, debug: bool):
    lib = importlib.import_module(library)
    if library == "accelerate":  # its process-wide singletons survive fork
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
    state = lib.PartialState(cpu=True)
    state.debug = debug
    return state, importlib.import_module(f"{library}.utils")


def padded(library: str) -> dict:
    state, u = _fresh(library, debug=False)
    rank = state.process_index
    data = {"rows": torch.arange(2 + rank, dtype=torch.float32), "grid": torch.ones(2, 1 + 2 * rank),
            "scalar": torch.tensor(float(rank)), "pair": Pair(torch.ones(rank + 1, dtype=torch.int64), torch.ones(0))}
    out = {"end": u.pad_across_processes(data, dim=0, pad_index=-1),
           "first": u.pad_across_processes(data["rows"], pad_first=True, pad_index=7),
           "last dim": u.pad_across_processes(data["grid"], dim=-1)}
    return torch.utils._pytree.tree_map(lambda t: t.tolist() if torch.is_tensor(t) else t, out)


def test_padding_odd_shapes_in_two_processes_matches():
    ours, theirs = launch(padded, 2, "nbaccel"), launch(padded, 2, "accelerate")
    assert ours == theirs
    assert ours[0]["first"] == [7.0, 0.0, 1.0] and ours[0]["last dim"] == [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]


def mismatched(library: str) -> dict:
    state, u = _fresh(library, debug=True)
    rank = state.process_index
    ops = importlib.import_module("accelerate.utils.operations" if library == "accelerate" else "nbaccel.utils")
    calls = {"gather": lambda: u.gather(torch.ones(2 + rank)),
             "gather a dict": lambda: u.gather({"x": torch.ones(2), "y": torch.ones(1 + rank)}),
             "reduce": lambda: u.reduce(torch.ones(2 + rank)),
             "broadcast": lambda: u.broadcast(torch.ones(2 + rank)),
             "pad ndim": lambda: u.pad_across_processes(torch.ones((2,) * (1 + rank))),
             "same shapes": lambda: u.gather(torch.ones(2)).shape[0]}
    seen = {}
    for name, call in calls.items():
        try:
            seen[name] = repr(call())
        except ops.DistributedOperationException:
            seen[name] = "DistributedOperationException"
        state.wait_for_everyone()
    return seen


def test_debug_mode_raises_for_every_mismatched_collective():
    ours, theirs = launch(mismatched, 2, "nbaccel"), launch(mismatched, 2, "accelerate")
    assert ours == theirs
    assert set(ours[0].values()) == {"DistributedOperationException", "4"}
