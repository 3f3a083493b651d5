"""Preflight on a machine with GPUs, without one: the CUDA count is the only thing faked.

Everything else (config validation, worker settings, the start-method choice) is the real code
path a GPU machine runs; ``scripts/check_gpu.py`` runs the real launches on real GPUs.
"""

from __future__ import annotations

import pytest

from nbaccel.config import LaunchConfig
from nbaccel.errors import ConfigError
from nbaccel.launch import preflight
from nbaccel.launch.preflight import plan_launch


@pytest.fixture
def gpus(monkeypatch):
    def have(count: int) -> None:
        monkeypatch.setattr(preflight, "cuda_device_count", lambda: count)
        monkeypatch.setattr(preflight, "tpu_detected", lambda: False)
    return have


def test_one_worker_per_gpu_by_default(gpus):
    gpus(4)
    plan = plan_launch(LaunchConfig(mixed_precision="bf16"))
    assert (plan.num_processes, plan.device_kind, plan.visible_gpus, plan.threads) == (4, "cuda", None, 1)
    assert plan.settings.distributed_type == "MULTI_GPU" and plan.settings.use_cpu is False
    assert plan.settings.mixed_precision == "bf16" and plan.note is None


def test_gpu_ids_pick_the_visible_devices(gpus):
    gpus(4)
    plan = plan_launch(LaunchConfig(gpu_ids="1,3"))
    assert (plan.num_processes, plan.visible_gpus) == (2, "1,3")


def test_use_cpu_ignores_the_gpus(gpus):
    gpus(2)
    plan = plan_launch(LaunchConfig(use_cpu=True, num_processes=2))
    assert plan.device_kind == "cpu" and plan.settings.distributed_type == "MULTI_CPU"


def test_a_gpu_id_that_is_not_there_is_named(gpus):
    gpus(2)
    with pytest.raises(ConfigError) as info:
        plan_launch(LaunchConfig(gpu_ids="0,5"))
    assert (info.value.key, info.value.valid) == ("gpu_ids", [0, 1])
    assert "names GPU 5, but only 2 are visible" in str(info.value)


def test_more_workers_than_gpus_is_refused(gpus):
    gpus(2)
    with pytest.raises(ConfigError) as info:
        plan_launch(LaunchConfig(num_processes=3))
    assert (info.value.key, info.value.value, info.value.valid) == ("num_processes", 3, "1..2")
    assert "use_cpu=True" in str(info.value)


def test_multi_gpu_without_a_gpu_is_refused(gpus):
    gpus(0)
    with pytest.raises(ConfigError) as info:
        plan_launch(LaunchConfig(distributed_type="MULTI_GPU"))
    assert info.value.key == "distributed_type"
