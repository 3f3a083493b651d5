"""Resuming on a GPU moves Adam's moments to the device but keeps its ``step`` counter on CPU, as torch does.

CUDA is faked (``tests/gpu_fakes.py``): what reaches the wrapped optimizer's ``load_state_dict`` is recorded.
"""

from __future__ import annotations

import pytest
import torch

from nbaccel.training.optimizer import AcceleratedOptimizer
from tests.gpu_fakes import fake_cuda_world


def _stepped(**options) -> torch.optim.Optimizer:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1, **options)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return optimizer


def _devices_loaded(monkeypatch, optimizer: torch.optim.Optimizer, resume: bool) -> dict[str, set[str]]:
    fake_cuda_world(monkeypatch)
    seen: list[dict] = []
    saved = optimizer.state_dict()
    monkeypatch.setattr(optimizer, "load_state_dict", seen.append)
    wrapped = AcceleratedOptimizer(optimizer, device=torch.device("cuda", 0))
    if resume:
        seen.clear()
        wrapped.load_state_dict(saved)
    devices: dict[str, set[str]] = {}
    for entries in seen[-1]["state"].values():
        for key, value in entries.items():
            devices.setdefault(key, set()).add(value.device.type)
    return devices


@pytest.mark.parametrize("resume", [False, True])
def test_adam_step_stays_on_cpu_while_its_moments_move(monkeypatch, resume):
    devices = _devices_loaded(monkeypatch, _stepped(), resume)
    assert devices == {"step": {"cpu"}, "exp_avg": {"cuda"}, "exp_avg_sq": {"cuda"}}


def test_a_capturable_adam_gets_its_step_on_the_device(monkeypatch):
    devices = _devices_loaded(monkeypatch, _stepped(capturable=False), resume=True)
    assert devices["step"] == {"cpu"}
    optimizer = _stepped()
    for group in optimizer.param_groups:
        group["capturable"] = True
    assert _devices_loaded(monkeypatch, optimizer, resume=True)["step"] == {"cuda"}
