"""The device_map path walks one way (plan, check, load, dispatch), one function names one device, and a
plan that places twice prepares once (CUDA is never touched: GPUs are faked)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import nbaccel.hardware
from nbaccel.big_modeling import sizes as sizes_module
from nbaccel.big_modeling.device_map import plan_device_map
from nbaccel.big_modeling.map_devices import map_device
from nbaccel.big_modeling.dispatch import cpu_offload, cpu_offload_with_hook, dispatch_model
from nbaccel.big_modeling.init import init_empty_weights
from nbaccel.errors import DeviceMapError
from tests.test_package import _nbaccel_imports


def test_the_walk_goes_plan_then_load_then_dispatch_and_never_back():
    """map_devices (one device) <- device_map (plan, check) <- map_entries (what dispatch hooks) <- dispatch
    <- loading: no import points back."""
    edges = _nbaccel_imports()
    walk = ["map_devices", "device_map", "map_entries", "dispatch", "loading"]  # each may import only those before it
    back = {m: sorted(n for n in walk[i + 1:] if f"nbaccel.big_modeling.{n}" in edges[f"nbaccel.big_modeling.{m}"])
            for i, m in enumerate(walk)}
    assert back == {m: [] for m in walk}
    loading = edges["nbaccel.big_modeling.loading"]
    assert {"nbaccel.big_modeling.dispatch", "nbaccel.big_modeling.map_entries"} <= loading


@pytest.mark.parametrize(("device", "expected"), [(torch.device("cpu"), "cpu"), ("disk", "disk"), ("meta", "meta"),
                                                  ("cuda", 0), ("cuda:2", 2), (torch.device("cuda", 1), 1)])
def test_one_device_is_named_as_a_device_map_names_it(device, expected):
    assert map_device(device, on_this_machine=False) == expected


def test_a_device_that_is_none_or_a_gpu_this_machine_lacks_is_refused(monkeypatch):
    monkeypatch.setattr(nbaccel.hardware, "cuda_device_count", lambda: 1)
    assert map_device(0) == 0
    with pytest.raises(DeviceMapError, match="has 1 visible GPU") as info:
        map_device("cuda:3")
    assert info.value.value == 3
    with pytest.raises(DeviceMapError, match="not a device") as info:
        map_device("tpu")
    assert info.value.value == "tpu" and "'cpu', 'disk'" in str(info.value)


def test_execution_devices_are_checked_as_before(monkeypatch):
    """cpu_offload, cpu_offload_with_hook and dispatch_model refuse a GPU this machine lacks, naming it."""
    monkeypatch.setattr(nbaccel.hardware, "cuda_device_count", lambda: 0)
    for offload in (lambda m: cpu_offload(m, 5), lambda m: cpu_offload_with_hook(m, 5),
                    lambda m: dispatch_model(m, {"": "cpu"}, main_device=5)):
        with pytest.raises(DeviceMapError, match="GPU 5, but this machine has 0 visible GPU"):
            offload(nn.Linear(2, 2))


class PreTrainedModel(nn.Module):
    """Named as transformers' base class, which is what the tied-weights config check looks for."""


class UntiedLM(PreTrainedModel):
    """Its config says the head is tied to the embedding; its weights are not."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(tie_word_embeddings=True, is_encoder_decoder=False)
        self.embed = nn.Embedding(64, 64)
        self.blocks = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
        self.head = nn.Linear(64, 64, bias=False)

    def get_output_embeddings(self) -> nn.Module:
        return self.head


def test_a_plan_that_reserves_offload_slots_says_an_untied_config_once(monkeypatch, caplog):
    """The reserving placement shares the first one's preparation, so its warning is not repeated."""
    monkeypatch.setattr(nbaccel.hardware, "cuda_device_count", lambda: 1)
    monkeypatch.setattr(sizes_module, "_free_gpu_memory", lambda i: 80 * 2**30)
    monkeypatch.setattr(sizes_module, "_available_cpu_memory", lambda: 10**9)
    with init_empty_weights():
        model = UntiedLM()
    with caplog.at_level(logging.WARNING, logger="nbaccel.big_modeling.device_map"):
        plan = plan_device_map(model, "sequential", {0: 3 * 16640 + 16384, "cpu": 10**6}, reserved_slots=3)
    assert 0 in plan.device_map.values() and "cpu" in plan.device_map.values()  # it offloads: two placements
    said = [r for r in caplog.records if "config ties weights" in r.getMessage()]
    assert len(said) == 1
