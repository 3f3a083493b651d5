"""Names Accelerate users import: DistributedType, PartialState/AcceleratorState, RNG sync, OOM retries, hooks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import nbaccel
from nbaccel.config import LaunchConfig
from nbaccel.environment import WorkerSettings, read_worker_settings, worker_environment
from tests.training.helpers import flat_weights, launch, model_and_optimizer


def test_distributed_type_members_are_the_strings_used_before():
    assert ([m.value for m in nbaccel.DistributedType][:6]
            == ["NO", "MULTI_CPU", "MULTI_GPU", "XLA", "FSDP", "DEEPSPEED"])
    assert nbaccel.DistributedType.MULTI_NPU == "MULTI_NPU"  # other hardware is named (code lists it in tuples)
    assert nbaccel.DistributedType.MULTI_CPU == "MULTI_CPU" and nbaccel.DistributedType.XLA == "XLA"
    assert f"{nbaccel.DistributedType.NO}" == "NO" and json.dumps(nbaccel.DistributedType.FSDP) == '"FSDP"'
    accelerator = nbaccel.Accelerator()
    assert accelerator.distributed_type is nbaccel.DistributedType.NO
    assert "distributed_type='NO'" in repr(accelerator)


def test_configs_and_worker_settings_hold_the_one_distributed_type(tmp_path):
    config = LaunchConfig(distributed_type="FSDP")
    assert config.distributed_type is nbaccel.DistributedType.FSDP
    assert config.to_mapping()["distributed_type"] == "FSDP" and type(config.to_mapping()["distributed_type"]) is str
    nbaccel.save_config(config, tmp_path / "config.yaml")
    assert "distributed_type: FSDP\n" in (tmp_path / "config.yaml").read_text()
    assert nbaccel.load_config(tmp_path / "config.yaml").distributed_type is nbaccel.DistributedType.FSDP
    settings = WorkerSettings(distributed_type="MULTI_CPU")
    assert settings.distributed_type is nbaccel.DistributedType.MULTI_CPU
    assert read_worker_settings(worker_environment(settings)).distributed_type is nbaccel.DistributedType.MULTI_CPU
    with pytest.raises(nbaccel.ConfigError) as info:
        WorkerSettings(distributed_type="MULTI_NPU")
    assert info.value.key == "distributed_type" and "FSDP" in info.value.valid
    with pytest.raises(nbaccel.ConfigError) as info:
        LaunchConfig(distributed_type="BOGUS")
    assert info.value.key == "distributed_type" and info.value.valid == ("NO", "MULTI_CPU", "MULTI_GPU", "XLA", "FSDP",
                                                                          "DEEPSPEED")
    with pytest.raises(nbaccel.ConfigError) as info:
        LaunchConfig(distributed_type=nbaccel.DistributedType.MULTI_XPU)
    assert info.value.value == "MULTI_XPU" and "MULTI_XPU" not in info.value.valid
    with pytest.raises(nbaccel.ConfigError, match="no engine for") as info:
        WorkerSettings(distributed_type=nbaccel.DistributedType.MULTI_HPU)
    assert info.value.valid == ("NO", "MULTI_CPU", "MULTI_GPU", "XLA", "FSDP", "DEEPSPEED")


def _states() -> dict:
    accelerator = nbaccel.Accelerator()
    partial = nbaccel.PartialState()
    full = nbaccel.AcceleratorState()
    return {"state_type": type(accelerator.state).__name__, "type": full.distributed_type,
            "is_enum": isinstance(partial.distributed_type, nbaccel.DistributedType),
            "fields": (partial.num_processes, partial.process_index, partial.local_process_index,
                       str(partial.device), partial.is_main_process, partial.is_last_process,
                       partial.use_distributed, partial.initialized, full.mixed_precision),
            "only_main": partial.on_main_process(lambda: "main")()}


def test_partial_state_and_accelerator_state_expose_accelerates_attributes():
    results = launch(_states, 2)
    assert results[0]["state_type"] == "AcceleratorState"
    assert results[1]["type"] == nbaccel.DistributedType.MULTI_CPU and results[1]["is_enum"]
    assert results[0]["fields"] == (2, 0, 0, "cpu", True, False, True, True, "no")
    assert results[1]["fields"] == (2, 1, 1, "cpu", False, True, True, True, "no")
    assert (results[0]["only_main"], results[1]["only_main"]) == ("main", None)


def _synchronized_draws() -> tuple[list[float], list[float]]:
    state = nbaccel.PartialState()
    nbaccel.set_seed(100 + state.process_index)
    generator = torch.Generator().manual_seed(state.process_index)
    nbaccel.synchronize_rng_states(["torch", "generator"], generator=generator)
    return torch.rand(3).tolist(), torch.rand(3, generator=generator).tolist()


def test_synchronize_rng_states_gives_every_process_the_main_process_state():
    results = launch(_synchronized_draws, 2)
    assert results[0] == results[1]
    with pytest.raises(nbaccel.ConfigError) as info:
        nbaccel.synchronize_rng_states(["numpy"])
    assert info.value.valid == ("torch", "cuda", "xla", "generator")
    with pytest.raises(nbaccel.ConfigError, match=re.escape("generator=...")):
        nbaccel.synchronize_rng_states(["generator"])


def test_find_executable_batch_size_retries_smaller_after_out_of_memory_only():
    tried = []

    @nbaccel.find_executable_batch_size(starting_batch_size=100)
    def train(batch_size: int, scale: int) -> int:
        tried.append(batch_size)
        if batch_size > 70:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")
        return batch_size * scale

    assert train(2) == 128 and tried == [100, 90, 81, 72, 64]
    with pytest.raises(TypeError, match="first argument"):
        train(32, 2)

    @nbaccel.find_executable_batch_size(starting_batch_size=8)
    def broken(batch_size: int) -> None:
        raise ValueError("not memory")

    with pytest.raises(ValueError, match="not memory"):
        broken()

    @nbaccel.find_executable_batch_size(starting_batch_size=2)
    def never_fits(batch_size: int) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")

    with pytest.raises(RuntimeError, match="no batch size"):
        never_fits()


def test_save_and_load_state_pre_hooks_see_accelerates_arguments_and_can_be_removed(tmp_path):
    accelerator = nbaccel.Accelerator()
    model, _optimizer = accelerator.prepare(*model_and_optimizer())
    seen: dict = {}

    def save_hook(models, weights, output_dir):
        seen["save"] = (models, len(weights), sorted(weights[0]))
        torch.save(weights.pop(0), Path(output_dir) / "my_model.pt")  # saved the hook's own way

    handle = accelerator.register_save_state_pre_hook(save_hook)
    folder = Path(accelerator.save_state(tmp_path / "ckpt"))
    assert seen["save"] == ([model], 1, ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"])
    assert (folder / "my_model.pt").is_file() and not (folder / "model.safetensors").exists()
    handle.remove()
    accelerator.save_state(tmp_path / "ckpt")
    assert (folder / "model.safetensors").is_file() and not (folder / "my_model.pt").exists()

    saved = flat_weights(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)

    def load_hook(models, input_dir):
        seen["load"] = (list(models), input_dir)
        models.pop(0)  # loaded the hook's own way: here, not at all

    handle = accelerator.register_load_state_pre_hook(load_hook)
    accelerator.load_state(folder, load_kwargs={"weights_only": True})
    assert seen["load"] == ([model], str(folder))
    assert torch.equal(flat_weights(model), saved + 1.0)
    handle.remove()
    accelerator.load_state(folder)
    assert torch.equal(flat_weights(model), saved)
    with pytest.raises(TypeError, match="bogus"):  # load_kwargs reach torch.load
        accelerator.load_state(folder, load_kwargs={"bogus": 1})


def test_unwrap_model_keeps_torch_compile_unless_asked():
    accelerator = nbaccel.Accelerator()
    compiled = torch.compile(torch.nn.Linear(2, 2))  # compiles lazily: nothing runs here
    assert accelerator.unwrap_model(compiled) is compiled
    assert accelerator.unwrap_model(compiled, keep_fp32_wrapper=True, keep_torch_compile=False) is compiled._orig_mod
    assert list(accelerator.get_state_dict(compiled)) == ["weight", "bias"]
