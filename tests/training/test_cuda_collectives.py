"""Under NCCL every collective nbaccel issues gets a CUDA tensor (CUDA faked: see ``tests/gpu_fakes.py``).

An NCCL group carries CUDA tensors only; a CPU seed or RNG state broadcast on it fails with
"No backend type associated with device type cpu" (``init_process_group("cuda:gloo")``
reproduces that on CPU). These tests record what each collective is handed while the process
state says ``cuda:0``.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from nbaccel import ops
from nbaccel.data_loader import prepare_data_loader
from nbaccel.random import synchronize_rng_states
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
