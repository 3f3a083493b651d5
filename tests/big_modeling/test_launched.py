"""Big-model inference inside two launched workers gives the full model's outputs, exactly."""

from __future__ import annotations

import os

import torch

from nbaccel import load_checkpoint_and_dispatch, notebook_launcher
from nbaccel.errors import UnsafeCheckpointError
from tests.big_modeling.helpers import (
    empty_model,
    make_model,
    sample_ids,
    save_checkpoint,
)

DEVICE_MAP = {"embed": "cpu", "positions": "cpu", "blocks.0": "cpu", "blocks.1": "disk",
              "blocks.2": "disk", "blocks.3": "disk", "norm": "disk", "head": "cpu"}


def test_each_launched_worker_dispatches_and_matches_the_full_model(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with torch.no_grad():
        reference = make_model()(sample_ids())
    checkpoint = save_checkpoint(make_model(), tmp_path / "ckpt", shards=2)
    # dispatched here, then used in forked workers: their prefetch must not wait on a thread
    # that only exists in this process
    inherited = load_checkpoint_and_dispatch(empty_model(), checkpoint, DEVICE_MAP)
    inherited(sample_ids())

    def worker(path):
        model = load_checkpoint_and_dispatch(empty_model(), path, "auto",
                                             max_memory={"cpu": 9000},
                                             no_split_module_classes=["Block"])
        with torch.no_grad():
            own, shared = model(sample_ids()), inherited(sample_ids())
        return {"own": own, "inherited": shared, "map": model.hf_device_map,
                "rank": int(os.environ["RANK"])}

    results = notebook_launcher(worker, (str(checkpoint),), num_processes=2, return_all=True,
                                timeout=120)
    assert sorted(results) == [0, 1]
    for rank, result in results.items():
        assert result["rank"] == rank
        assert "disk" in result["map"].values()
        assert torch.equal(result["own"], reference)
        assert torch.equal(result["inherited"], reference)


def test_a_worker_refusing_a_malicious_pickle_raises_the_same_type(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    marker = tmp_path / "pwned"

    class RunsCode:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "pytorch_model.bin"
    torch.save({"embed.weight": RunsCode()}, path)

    def worker(checkpoint):
        load_checkpoint_and_dispatch(empty_model(), checkpoint, {"": "cpu"})

    try:
        notebook_launcher(worker, (str(path),), num_processes=2, timeout=120)
    except UnsafeCheckpointError as exc:
        assert exc.path == str(path)
    else:
        raise AssertionError("expected UnsafeCheckpointError")
    assert not marker.exists()
