"""FSDP2 full-state checkpoints on CPU processes: rank 0 alone reads them, and every node's writer gets the full
state."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

import nbaccel
from tests.training.helpers import (
    BlockStack,
    cpu_fsdp2,
    launch,
    regression_data,
    train_steps,
)

pytestmark = cpu_fsdp2


def _prepared(project: nbaccel.ProjectConfiguration | None = None) -> tuple:
    accelerator = nbaccel.Accelerator(fsdp_plugin=nbaccel.FullyShardedDataParallelPlugin(
        transformer_cls_names_to_wrap=["Block"]), project_config=project)
    nbaccel.set_seed(0)
    model = BlockStack()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)  # state per parameter: the resume needs it
    loader = DataLoader(regression_data(64), batch_size=8)
    return (accelerator, *accelerator.prepare(model, optimizer, loader))


def _epoch(accelerator: nbaccel.Accelerator, model, optimizer, loader) -> list[float]:
    return [accelerator.gather(torch.tensor([loss])).sum().item()
            for loss in train_steps(accelerator, model, optimizer, loader)]


def _watch_reads() -> list[str]:
    """The names of the checkpoint files this process opens from now on (safetensors and torch.load both)."""
    import safetensors.torch

    from nbaccel.training import state_loading

    opened: list[str] = []
    real_load_file, real_load_state = safetensors.torch.load_file, state_loading.load_state_file

    def load_file_spy(path, *args, **kwargs):  # handed /proc/self/fd/<n>: the file load_state opened and checked
        opened.append(Path(os.readlink(path) if str(path).startswith("/proc/self/fd/") else path).name)
        return real_load_file(path, *args, **kwargs)

    def load_state_spy(path, *args, **kwargs):
        opened.append(Path(path).name)
        return real_load_state(path, *args, **kwargs)

    safetensors.torch.load_file = load_file_spy
    state_loading.load_state_file = load_state_spy
    return opened


def _resume(folder: str) -> dict:
    accelerator, model, optimizer, loader = _prepared()
    _epoch(accelerator, model, optimizer, loader)
    accelerator.save_state(folder)
    first = _epoch(accelerator, model, optimizer, loader)
    opened = _watch_reads()
    accelerator.load_state(folder)
    again = _epoch(accelerator, model, optimizer, loader)
    return {"opened": sorted(opened), "first": first, "again": again}


def test_only_rank_0_reads_an_fsdp_checkpoint_and_the_resumed_run_repeats_exactly(tmp_path):
    results = launch(_resume, 2, str(tmp_path / "ckpt"))
    assert results[0]["opened"] == ["model.safetensors", "optimizer.bin", "random_states_0.pkl", "sampler.bin"]
    assert results[1]["opened"] == ["random_states_1.pkl", "sampler.bin"]  # no model or optimizer state
    for rank in (0, 1):
        assert results[rank]["again"] == results[rank]["first"]  # Adam's moments came back too, bit for bit


def _resume_damaged(folder: str) -> str:
    accelerator, _model, _optimizer, _loader = _prepared()
    accelerator.save_state(folder)
    if accelerator.is_main_process:
        path = Path(folder) / "model.safetensors"
        path.write_bytes(path.read_bytes()[:100])
    accelerator.wait_for_everyone()
    try:
        accelerator.load_state(folder)
    except nbaccel.CheckpointError as exc:  # each rank's own error comes back (none hangs in a broadcast)
        return str(exc)
    return "loaded"


def test_a_checkpoint_rank_0_refuses_is_refused_on_every_rank(tmp_path):
    results = launch(_resume_damaged, 2, str(tmp_path / "ckpt"))
    assert "model.safetensors" in results[0] and "truncated or corrupt" in results[0]
    assert results[1] == results[0]  # rank 1 read nothing: it raises rank 0's own error


def _two_nodes(root: str) -> dict:
    """Four ranks that believe they are two machines of two (each machine its own disk: its own folder)."""
    from nbaccel.identity import WorkerIdentity, current_identity, set_identity

    rank = current_identity().rank
    node = rank // 2
    set_identity(WorkerIdentity(rank=rank, local_rank=rank % 2, world_size=4, local_world_size=2, node_rank=node))
    accelerator, model, optimizer, loader = _prepared(nbaccel.ProjectConfiguration(save_on_each_node=True))
    _epoch(accelerator, model, optimizer, loader)
    disk = os.path.join(root, f"node{node}")
    accelerator.save_model(model, os.path.join(disk, "model"))
    accelerator.save_state(os.path.join(disk, "state"))
    return {"local_main": accelerator.is_local_main_process, "node": node}


def test_save_on_each_node_gives_each_nodes_writer_the_full_state(tmp_path):
    results = launch(_two_nodes, 4, str(tmp_path))
    assert [results[r]["local_main"] for r in range(4)] == [True, False, True, False]
    keys = sorted(BlockStack().state_dict())
    saved = {node: load_file(str(tmp_path / f"node{node}" / "model" / "model.safetensors")) for node in (0, 1)}
    states = {node: load_file(str(tmp_path / f"node{node}" / "state" / "model.safetensors")) for node in (0, 1)}
    optims = {node: torch.load(tmp_path / f"node{node}" / "state" / "optimizer.bin", weights_only=True)
              for node in (0, 1)}
    for node in (0, 1):
        assert sorted(saved[node]) == keys and sorted(states[node]) == keys
        assert sorted(optims[node]["state"]) == keys and all(
            optims[node]["state"][k]["exp_avg"].shape == saved[0][k].shape for k in keys)
    for key in keys:
        assert torch.equal(saved[0][key], saved[1][key]) and torch.equal(states[0][key], states[1][key])
        assert torch.equal(optims[0]["state"][key]["exp_avg"], optims[1]["state"][key]["exp_avg"])

