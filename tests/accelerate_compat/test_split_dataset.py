"""``split_between_processes`` on a ``datasets.Dataset`` gives each rank a Dataset of its rows, as in Accelerate."""

from __future__ import annotations

import importlib

import pytest

from tests.training.helpers import launch

pytest.importorskip("accelerate")
pytest.importorskip("datasets")


def split(library: str, apply_padding: bool) -> dict:
    from datasets import Dataset

    lib = importlib.import_module(library)
    if library == "accelerate":
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
    state = lib.PartialState(cpu=True)
    rows = Dataset.from_dict({"text": [f"t{i}" for i in range(5)], "label": list(range(5))})
    with state.split_between_processes(rows, apply_padding=apply_padding) as mine:
        return {"type": type(mine).__name__, "rows": mine.to_dict()}


@pytest.mark.parametrize("apply_padding", [False, True])
def test_each_rank_gets_a_dataset_of_its_rows(apply_padding):
    ours = launch(split, 2, "nbaccel", apply_padding)
    assert ours == launch(split, 2, "accelerate", apply_padding)
    assert ours[0] == {"type": "Dataset", "rows": {"text": ["t0", "t1", "t2"], "label": [0, 1, 2]}}
    assert ours[1]["rows"]["label"] == ([3, 4, 4] if apply_padding else [3, 4])
