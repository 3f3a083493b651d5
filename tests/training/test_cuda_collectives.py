"""Under NCCL every collective nbaccel issues gets a CUDA tensor, and CPU collectives get a CPU backend (CUDA faked).

An NCCL group carries CUDA tensors only; a CPU seed or RNG state broadcast on it fails with
"No backend type associated with device type cpu" (``init_process_group("cuda:gloo")``
reproduces that on CPU). These tests record what each collective is handed while the process
state says ``cuda:0``.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.distributed.tensor
from torch.utils.data import DataLoader

from nbaccel import Accelerator, FullyShardedDataParallelPlugin, ops
from nbaccel.errors import ConfigError
from nbaccel.state import ProcessState
from nbaccel.training.fsdp import shard_model
from nbaccel.training.loader_preparation import prepare_data_loader
from nbaccel.training.random import synchronize_rng_states
from tests.gpu_fakes import fake_cuda_world


def test_a_shuffled_loader_broadcasts_its_seed_on_the_gpu(monkeypatch):
    log = fake_cuda_world(monkeypatch)
    loader = prepare_data_loader(DataLoader(list(range(16)), batch_size=2, shuffle=True),
                                 device=torch.device("cuda", 0), num_processes=2, process_index=0)
    assert log.calls and log.off_device() == []
    assert loader.sync_generator is not None and loader.sync_generator.device.type == "cpu"


def test_a_loader_with_its_own_generator_broadcasts_the_state_on_the_gpu(monkeypatch):
    log = fake_cuda_world(monkeypatch)
    generator = torch.Generator().manual_seed(3)
    loader = prepare_data_loader(DataLoader(list(range(16)), batch_size=2, shuffle=True, generator=generator),
                                 device=torch.device("cuda", 0), num_processes=2, process_index=0)
    assert [name for name, _ in log.calls] == ["broadcast"] and log.off_device() == []
    assert torch.equal(loader.sync_generator.get_state(), torch.Generator().manual_seed(3).get_state())


def test_cpu_tensors_travel_through_the_gpu_and_come_back_on_cpu(monkeypatch):
    log = fake_cuda_world(monkeypatch)
    value = torch.tensor([1.0, 2.0])
    assert ops.broadcast(value) is value
    assert ops.reduce(value, "sum").device.type == "cpu"
    gathered = ops.gather(torch.arange(3))
    assert gathered.device.type == "cpu" and gathered.tolist() == [0, 1, 2, 0, 1, 2]
    assert ops.pad_across_processes(torch.ones(2)).device.type == "cpu"
    synchronize_rng_states(["torch", "generator"], generator=torch.Generator())
    assert len(log.calls) >= 6 and log.off_device() == []


def test_a_group_that_carries_cpu_tensors_gets_them_unmoved(monkeypatch):
    log = fake_cuda_world(monkeypatch, group_device_types=frozenset({"cuda", "cpu"}))
    ops.broadcast(torch.ones(1))
    assert [device.type for _, device in log.calls] == ["cpu"]


# --------------------------------------------------------------------------- the backend on CUDA machines


@pytest.fixture
def cuda_worker(monkeypatch):
    """Rank 0 of 2 on a machine with 2 (faked) GPUs; ``init_process_group`` records its arguments."""
    from nbaccel import process_group, process_state

    calls: list[dict] = []
    monkeypatch.setattr(process_state, "_shared", {})
    monkeypatch.setattr(process_group, "cuda_device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.append(kwargs))
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)

    def fsdp(config: dict) -> None:
        monkeypatch.setenv("NBACCEL_DISTRIBUTED_TYPE", "FSDP")
        monkeypatch.setenv("NBACCEL_FSDP_CONFIG", json.dumps(config))

    return calls, fsdp


def test_plain_ddp_on_gpus_uses_nccl(cuda_worker):
    calls, _ = cuda_worker
    state = ProcessState()
    assert (state.device, state.backend) == (torch.device("cuda", 0), "nccl")
    assert calls == [{"backend": "nccl", "rank": 0, "world_size": 2, "device_id": torch.device("cuda", 0)}]


@pytest.mark.parametrize("config", [{"fsdp_offload_params": True, "fsdp_state_dict_type": "SHARDED_STATE_DICT"},
                                    {"fsdp_state_dict_type": "FULL_STATE_DICT"}])
def test_fsdp_that_offloads_or_gathers_on_cpu_gets_a_cpu_backend_too(cuda_worker, config):
    calls, fsdp = cuda_worker
    fsdp(config)
    assert ProcessState().backend == "cuda:nccl,cpu:gloo"
    assert calls[0]["backend"] == "cuda:nccl,cpu:gloo"


def test_sharded_fsdp_without_offload_keeps_plain_nccl(cuda_worker):
    _, fsdp = cuda_worker
    fsdp({"fsdp_offload_params": False, "fsdp_state_dict_type": "SHARDED_STATE_DICT"})
    assert ProcessState().backend == "nccl"


def test_an_fsdp_plugin_with_cpu_offload_given_in_code_gets_a_cpu_backend(cuda_worker):
    calls, _ = cuda_worker
    Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(cpu_offload=True))
    assert calls[0]["backend"] == "cuda:nccl,cpu:gloo"


def test_cpu_offload_on_a_group_without_cpu_is_refused_before_sharding(monkeypatch):
    fake_cuda_world(monkeypatch)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError) as info:
        shard_model(model, FullyShardedDataParallelPlugin(cpu_offload=True), torch.device("cuda", 0), 2, [])
    assert (info.value.key, info.value.value, info.value.valid) == ("backend", "cuda:nccl", "cuda:nccl,cpu:gloo")
    assert "Fix:" in str(info.value) and not isinstance(model.weight, torch.distributed.tensor.DTensor)


def test_a_group_someone_else_made_still_gets_this_ranks_gpu(cuda_worker, monkeypatch):
    # e.g. the user's own init_process_group before Accelerator(): rank 1 must not stay on cuda:0
    calls, _ = cuda_worker
    current: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: current.append(torch.device(device)))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    for name, value in {"RANK": "1", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    state = ProcessState()
    assert state.device == torch.device("cuda", 1) and current == [torch.device("cuda", 1)]
    assert calls == []  # the existing group is kept


def _carries(backend: str) -> frozenset[str]:
    """The device types a backend string like ``cuda:nccl,cpu:gloo`` gives the default group."""
    if ":" not in backend:
        return frozenset({"cuda"} if backend == "nccl" else {"cpu"})
    return frozenset(item.split(":")[0] for item in backend.split(","))


@pytest.mark.parametrize("join", ["pool", "ray"])
def test_a_pools_group_takes_a_later_fsdp_cpu_offload_accelerator(cuda_worker, monkeypatch, join):
    from nbaccel.rank_lifecycle import RankLifecycle
    from nbaccel.launch.ray import actor as ray_actor
    from nbaccel.training.fsdp import _check_group_carries_cpu

    calls, _ = cuda_worker
    # the pool's rank joins its group when it starts, before any task says what it will train
    device = RankLifecycle().join_group() if join == "pool" else ray_actor.RankActor().join_group()
    assert device == "cuda:0" and len(calls) == 1
    monkeypatch.setattr(ops, "group_device_types", lambda: _carries(calls[0]["backend"]))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: calls[0]["backend"])
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(cpu_offload=True))  # a later task
    _check_group_carries_cpu()  # what shard_model refuses a plain NCCL group with
    assert accelerator.state.backend == "cuda:nccl,cpu:gloo" and len(calls) == 1
