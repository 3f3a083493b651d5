"""DeepSpeed through the Accelerator (ZeRO 2 and 3 on 2 CPU processes over gloo); skipped without deepspeed."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import nbaccel
from tests.training.helpers import (
    flat_weights,
    launch,
    model_and_optimizer,
    regression_data,
    train_steps,
)

pytest.importorskip("deepspeed")


def _train(stage: int | None, folder: str | None = None, gamma: float = 1.0) -> dict:
    plugin = None if stage is None else nbaccel.DeepSpeedPlugin(zero_stage=stage)
    accelerator = nbaccel.Accelerator(gradient_accumulation_steps=2, deepspeed_plugin=plugin)
    nbaccel.set_seed(0)
    model, optimizer = model_and_optimizer()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=gamma)
    loader = DataLoader(regression_data(64), batch_size=4)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    losses = train_steps(accelerator, model, optimizer, loader, scheduler)
    out = {"losses": losses, "type": accelerator.distributed_type, "lr": scheduler.get_last_lr(),
           "weights": flat_weights(accelerator.unwrap_model(model)) if stage != 3 else None,
           "full": {k: v.float().clone() for k, v in accelerator.get_state_dict(model).items()}}
    if folder is not None:
        accelerator.save_state(folder)
        again = train_steps(accelerator, model, optimizer, loader, scheduler)
        accelerator.load_state(folder)
        out["repeats"] = train_steps(accelerator, model, optimizer, loader, scheduler) == again
        accelerator.save_model(model, folder + "_model")
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_matches_ddp_and_checkpoints(stage, tmp_path):
    ddp = launch(_train, 2, None)[0]
    results = launch(_train, 2, stage, str(tmp_path / "ckpt"))
    ours = results[0]
    assert ours["type"] == "DEEPSPEED" and ddp["type"] == "MULTI_CPU"
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(ddp["losses"]), atol=1e-5, rtol=1e-5)
    for name, tensor in ddp["full"].items():
        torch.testing.assert_close(ours["full"][name], tensor, atol=1e-5, rtol=1e-5)
    assert ours["repeats"] and results[1]["repeats"]
    assert (tmp_path / "ckpt" / "pytorch_model").is_dir()
    assert (tmp_path / "ckpt_model" / "model.safetensors").is_file()


def _two_models() -> None:
    accelerator = nbaccel.Accelerator(deepspeed_plugin=nbaccel.DeepSpeedPlugin(zero_stage=1))
    accelerator.prepare(torch.nn.Linear(1, 1), torch.nn.Linear(1, 1))


def test_deepspeed_with_two_models_is_a_config_error():
    with pytest.raises(nbaccel.ConfigError, match="one model"):
        launch(_two_models, 2)


def test_the_engine_steps_the_scheduler_once_per_optimizer_step():
    # As in Accelerate: under DeepSpeed the engine owns the schedule (8 micro-batches, accumulation 2: 4 steps).
    result = launch(_train, 2, 2, None, 0.5)[0]
    assert result["lr"] == [pytest.approx(0.05 * 0.5**4)]


def test_deepspeed_in_a_single_process_joins_a_group_of_one():
    plain = launch(_train, 1, None)[0]
    ours = launch(_train, 1, 2)[0]
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(plain["losses"]), atol=1e-5, rtol=1e-5)
