"""The environment module: settings round-trip to workers, detection without side effects."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nbaccel import ConfigError
from nbaccel.environment import (
    DistributedEnv,
    WorkerSettings,
    read_distributed_env,
    read_worker_settings,
    worker_environment,
)
from nbaccel.hardware import fork_unsafe_reason, in_notebook, tpu_detected


def test_settings_round_trip_through_the_environment():
    settings = WorkerSettings(mixed_precision="fp16", use_cpu=True, distributed_type="FSDP", num_machines=2,
                              fsdp_config={"fsdp_version": 2}, deepspeed_config={"zero_stage": 2},
                              debug=True, launched=True)
    dist = DistributedEnv(rank=3, local_rank=1, world_size=4, local_world_size=2, node_rank=1,
                          master_addr="127.0.0.1", master_port=1234)
    env = worker_environment(settings, dist)
    assert read_worker_settings(env) == settings
    assert read_distributed_env(env) == dist


def test_accelerate_variables_are_honoured_when_ours_are_absent():
    got = read_worker_settings({"ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_USE_CPU": "true"})
    assert (got.mixed_precision, got.use_cpu) == ("bf16", True)


@pytest.mark.parametrize("env, key", [
    ({"NBACCEL_MIXED_PRECISION": "fp32"}, "NBACCEL_MIXED_PRECISION"),
    ({"NBACCEL_USE_CPU": "maybe"}, "NBACCEL_USE_CPU"),
    ({"NBACCEL_FSDP_CONFIG": "{not json"}, "NBACCEL_FSDP_CONFIG"),
    ({"NBACCEL_FSDP_CONFIG": "[1, 2]"}, "NBACCEL_FSDP_CONFIG"),
    ({"NBACCEL_NUM_MACHINES": "two"}, "NBACCEL_NUM_MACHINES"),
])
def test_bad_worker_variables_are_named(env, key):
    with pytest.raises(ConfigError) as info:
        read_worker_settings(env)
    assert info.value.key == key


def test_no_distributed_env_outside_a_launch():
    assert read_distributed_env({}) is None


def test_detection_does_not_initialize_cuda_and_fork_is_safe_here():
    code = ("import torch, nbaccel.hardware as e; e.cuda_device_count(); e.tpu_detected(); "
            "print(torch.cuda.is_initialized(), e.fork_unsafe_reason())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "None"]
    assert fork_unsafe_reason() is None
    assert in_notebook() is False


def test_tpu_override(monkeypatch):
    monkeypatch.setenv("NBACCEL_TPU", "1")
    assert tpu_detected() is True
    monkeypatch.setenv("NBACCEL_TPU", "0")
    assert tpu_detected() is False
