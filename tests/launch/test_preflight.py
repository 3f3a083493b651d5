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
    assert plan.settings.mixed_precision == "bf16"
    assert plan.note == "nbaccel: using 4 processes, one per visible GPU. Pass num_processes= to choose."


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


# --------------------------------------------------------------------------- fp8, refused at launch


def test_fp8_without_a_gpu_is_refused_before_any_worker_starts(tmp_path):
    from nbaccel import notebook_launcher

    marker = tmp_path / "started"
    with pytest.raises(ConfigError) as info:
        notebook_launcher(marker.touch, num_processes=2, mixed_precision="fp8", use_cpu=True)
    assert (info.value.key, info.value.value, info.value.valid) == ("mixed_precision", "fp8", ("no", "fp16", "bf16"))
    assert "runs on CPU" in str(info.value) and "Fix: use mixed_precision='bf16'" in str(info.value)
    assert not marker.exists()


@pytest.mark.parametrize(("capability", "ok"), [((7, 5), False), ((8, 0), False), ((8, 9), True), ((9, 0), True)])
def test_fp8_needs_gpus_of_compute_capability_8_9(gpus, monkeypatch, capability, ok):
    from nbaccel import fp8_support as fp8

    gpus(2)
    asked = []
    monkeypatch.setattr(fp8, "gpu_capabilities", lambda ids: asked.append(ids) or [capability, (9, 0)])
    monkeypatch.setattr(fp8.importlib.util, "find_spec", lambda name: object() if name == "torchao" else None)
    if ok:
        assert plan_launch(LaunchConfig(mixed_precision="fp8")).settings.mixed_precision == "fp8"
    else:
        with pytest.raises(ConfigError, match=f"has compute capability {capability[0]}.{capability[1]}"):
            plan_launch(LaunchConfig(mixed_precision="fp8"))
    assert asked == [(0, 1)]


def test_fp8_without_torchao_names_the_install(gpus, monkeypatch):
    from nbaccel import fp8_support as fp8
    from nbaccel.errors import MissingDependencyError

    gpus(1)
    monkeypatch.setattr(fp8, "gpu_capabilities", lambda ids: [(9, 0)])
    monkeypatch.setattr(fp8.importlib.util, "find_spec",
                        lambda name: object() if name == "transformer_engine" else None)
    with pytest.raises(MissingDependencyError) as info:
        plan_launch(LaunchConfig(mixed_precision="fp8"))
    assert (info.value.package, info.value.install) == ("torchao", "pip install torchao")
    assert "transformer_engine is installed" in str(info.value)


def test_fp8_where_nvml_cannot_tell_is_left_to_the_workers(gpus, monkeypatch):
    from nbaccel import fp8_support as fp8

    gpus(1)
    monkeypatch.setattr(fp8, "gpu_capabilities", lambda ids: None)
    monkeypatch.setattr(fp8.importlib.util, "find_spec", lambda name: object())
    assert plan_launch(LaunchConfig(mixed_precision="fp8")).num_processes == 1


# --------------------------------------------------------------------------- gpu_ids against CUDA_VISIBLE_DEVICES


def test_gpu_ids_count_the_gpus_the_notebook_sees(gpus, monkeypatch):
    gpus(2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    plan = plan_launch(LaunchConfig(gpu_ids="1"))
    assert (plan.num_processes, plan.visible_gpus) == (1, "3")


def test_gpu_ids_as_uuids_reach_the_workers(gpus, monkeypatch):
    gpus(2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa1111,GPU-bbbb2222")
    plan = plan_launch(LaunchConfig(gpu_ids="GPU-bbbb,0"))
    assert (plan.num_processes, plan.visible_gpus) == (2, "GPU-bbbb2222,GPU-aaaa1111")


def test_more_cpu_processes_than_cores_gets_a_note_not_a_refusal(gpus):
    from nbaccel.hardware import cpu_count

    gpus(0)
    cores = cpu_count()
    plan = plan_launch(LaunchConfig(num_processes=cores + 1))
    assert plan.num_processes == cores + 1 and plan.device_kind == "cpu"
    assert f"nbaccel: {cores + 1} CPU processes on {cores} cores: they take turns" in plan.note
    assert "take turns" not in (plan_launch(LaunchConfig(num_processes=cores)).note or "")
