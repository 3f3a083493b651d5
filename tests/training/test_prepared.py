"""The Accelerator's registry of what it prepared: preparing twice is a no-op, and save/load are given the registry."""

from __future__ import annotations

import os

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

import nbaccel
from nbaccel.training.plugins import ProjectConfiguration
from nbaccel.training.prepared import PreparedObjects, is_prepared
from nbaccel.training.state_loading import load_accelerator_state
from nbaccel.training.training_state import CheckpointContext, save_accelerator_state
from tests.training.helpers import (
    TinyMLP,
    flat_weights,
    launch,
    model_and_optimizer,
    regression_data,
    train_steps,
)


def _prepare_twice_and_train(folder: str) -> dict:
    accelerator = nbaccel.Accelerator()
    model, optimizer = model_and_optimizer()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    loader = DataLoader(regression_data(32), batch_size=4)
    once = accelerator.prepare(model, optimizer, loader, scheduler)
    twice = accelerator.prepare(*once)
    model, optimizer, loader, scheduler = twice
    again = (accelerator.prepare_model(model), accelerator.prepare_optimizer(optimizer),
             accelerator.prepare_data_loader(loader), accelerator.prepare_scheduler(scheduler))
    losses = train_steps(accelerator, model, optimizer, loader, scheduler)
    accelerator.save_state(folder)
    other = nbaccel.Accelerator()
    return {"same": [a is b for a, b in zip(once, twice)] + [a is b for a, b in zip(once, again)],
            "ddp": isinstance(model, DistributedDataParallel),
            "ddp_in_ddp": isinstance(getattr(model, "module", None), DistributedDataParallel),
            "counts": [len(accelerator._models), len(accelerator._optimizers), len(accelerator._dataloaders),
                       len(accelerator._schedulers)],
            "batches": len(losses), "weights": flat_weights(accelerator.unwrap_model(model)),
            "other_takes_it": other.prepare(model) is model and other._models == [model]}


def test_preparing_prepared_objects_again_on_two_ranks_returns_them_unchanged(tmp_path):
    folder = tmp_path / "ckpt"
    results = launch(_prepare_twice_and_train, 2, str(folder))
    for rank in (0, 1):
        result = results[rank]
        assert result["same"] == [True] * 8, rank
        assert result["ddp"] and not result["ddp_in_ddp"], rank
        assert result["counts"] == [1, 1, 1, 1], rank
        assert result["batches"] == 4 and result["other_takes_it"], rank  # 32 samples / 4 per batch / 2 ranks
    assert torch.equal(results[0]["weights"], results[1]["weights"])  # one DDP job: the ranks agree
    files = sorted(os.listdir(folder))
    assert "model.safetensors" in files and "model_1.safetensors" not in files
    assert "optimizer.bin" in files and "optimizer_1.bin" not in files and "scheduler_1.bin" not in files


def test_private_lists_are_views_of_the_registry():
    accelerator = nbaccel.Accelerator()
    model, optimizer = model_and_optimizer()
    model, optimizer = accelerator.prepare(model, optimizer)
    registry = accelerator.prepared
    assert accelerator._models is registry.models and accelerator._models == [model]
    assert accelerator._optimizers is registry.optimizers and accelerator._optimizers == [optimizer]
    handle = accelerator.register_save_state_pre_hook(lambda models, weights, output_dir: None)
    assert list(accelerator._save_model_state_pre_hook) == [handle.id]
    assert accelerator._save_model_state_pre_hook is registry.save_state_pre_hooks
    accelerator._models = []  # Accelerate's own way of forgetting them
    assert registry.models == [] and accelerator._models is registry.models
    counter = torch.optim.SGD(TinyMLP().parameters(), lr=0.1)
    accelerator.register_for_checkpointing(counter)
    accelerator.free_memory()
    assert registry.optimizers == [] and registry.custom_objects == [counter]  # as Accelerate: registered stay
    assert is_prepared(model) and not is_prepared(TinyMLP())


def test_save_and_load_are_given_the_registry_not_the_accelerator(tmp_path):
    torch.manual_seed(0)
    saved_model, fresh_model = TinyMLP(), TinyMLP()
    saved = PreparedObjects()
    saved.add("model", saved_model)
    context = CheckpointContext(process=nbaccel.ProcessState(), project=ProjectConfiguration(), step=3)
    save_accelerator_state(saved, context, tmp_path / "ckpt")
    loaded = PreparedObjects()
    loaded.add("model", fresh_model)
    result = load_accelerator_state(loaded, context, tmp_path / "ckpt")
    assert result.step == 3 and result.path == tmp_path / "ckpt"
    assert torch.equal(flat_weights(fresh_model), flat_weights(saved_model))


def test_the_registry_records_each_object_once_and_marks_it():
    registry = PreparedObjects()
    model = TinyMLP()
    assert registry.add("model", model) is model and registry.add("model", model) is model
    assert registry.models == [model] and model._is_accelerate_prepared and is_prepared(model)
    assert registry.list_of("scheduler") is registry.schedulers
    with pytest.raises(KeyError):
        registry.list_of("tokenizer")  # type: ignore[arg-type]  # an unknown kind is the test


def _deepspeed_with_a_stand_in_engine() -> dict:
    # A stand-in for the deepspeed package (not installed here): what prepare_deepspeed calls, no more.
    import importlib.machinery
    import sys
    import types

    class StandInEngine(torch.nn.Module):
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module

    calls = []

    def initialize(model, optimizer, lr_scheduler, config, dist_init_required):
        calls.append(config)
        return StandInEngine(model), optimizer, None, lr_scheduler

    stand_in = types.ModuleType("deepspeed")
    stand_in.__spec__ = importlib.machinery.ModuleSpec("deepspeed", None)
    stand_in.DeepSpeedEngine, stand_in.initialize = StandInEngine, initialize
    sys.modules["deepspeed"] = stand_in
    accelerator = nbaccel.Accelerator(deepspeed_plugin=nbaccel.DeepSpeedPlugin(zero_stage=0))
    model, optimizer = model_and_optimizer()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    loader = DataLoader(regression_data(16), batch_size=4)
    once = accelerator.prepare(model, optimizer, loader, scheduler)
    twice = accelerator.prepare(*once)
    return {"same": [a is b for a, b in zip(once, twice)], "engine_returned": accelerator.deepspeed_engine is once[0],
            "kinds": [type(o).__name__ for o in once], "initialize_calls": len(calls),
            "micro_batch": accelerator.deepspeed_config["train_micro_batch_size_per_gpu"],
            "registry": [accelerator._models == [once[0]], accelerator._optimizers == [once[1]],
                         accelerator._dataloaders == [once[2]], accelerator._schedulers == [once[3]]]}


def test_deepspeed_prepare_records_the_engine_in_the_registry_and_twice_is_a_no_op():
    result = launch(_deepspeed_with_a_stand_in_engine, 1)[0]
    assert result["kinds"] == ["StandInEngine", "DeepSpeedOptimizerWrapper", "DataLoaderShard",
                               "DeepSpeedSchedulerWrapper"]
    assert result["same"] == [True] * 4 and result["engine_returned"] and result["initialize_calls"] == 1
    assert result["registry"] == [True] * 4 and result["micro_batch"] == 4


def _prepare_the_inherited_model(model: torch.nn.Module) -> dict:
    prepared = nbaccel.Accelerator().prepare(model)
    return {"ddp": isinstance(prepared, DistributedDataParallel), "inherited_counts_as_prepared": is_prepared(model)}


def test_a_model_prepared_in_the_notebook_is_still_wrapped_in_the_workers():
    model = TinyMLP()
    assert nbaccel.Accelerator().prepare(model) is model and is_prepared(model)  # one process: no wrapper
    assert nbaccel.Accelerator().prepare(model) is model
    results = launch(_prepare_the_inherited_model, 2, model)
    assert results[0] == results[1] == {"ddp": True, "inherited_counts_as_prepared": False}
