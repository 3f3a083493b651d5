"""The Accelerator on one XLA replica (torch_xla's CPU runtime): real training, save and load.

Launched through ``notebook_launcher`` as on a TPU; the same function on a CPU process gives the
reference losses.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch_xla")

import torch  # noqa: E402

from nbaccel import notebook_launcher  # noqa: E402
from nbaccel.config import LaunchConfig  # noqa: E402

pytestmark = pytest.mark.xla


def make_job(seed: int = 0):
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(seed)
    x = torch.randn(64, 4)
    y = x @ torch.tensor([1.0, -2.0, 3.0, 0.5]) + 0.1
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)  # made before prepare(): on CPU params
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    return model, optimizer, loader


def run_epochs(accelerator, model, optimizer, loader, epochs):
    losses = []
    for _ in range(epochs):
        for xb, yb in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(xb).squeeze(-1), yb)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
    return losses


def train(folder: str, accumulation: int = 1, mixed_precision: str = "no"):
    from nbaccel import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=accumulation, mixed_precision=mixed_precision)
    model, optimizer, loader = accelerator.prepare(*make_job())
    first = run_epochs(accelerator, model, optimizer, loader, 2)
    accelerator.save_state(folder)
    after_save = run_epochs(accelerator, model, optimizer, loader, 1)
    accelerator.load_state(folder)
    after_load = run_epochs(accelerator, model, optimizer, loader, 1)
    accelerator.save_model(model, Path(folder) / "model")
    accelerator.save({"note": torch.tensor([1.0, 2.0], device=accelerator.device)}, Path(folder) / "obj.pt")
    seen = accelerator.gather(torch.tensor([3.0], device=accelerator.device))
    return {"device": str(accelerator.device), "type": accelerator.distributed_type, "first": first,
            "after_save": after_save, "after_load": after_load, "gathered": seen,
            "weights": accelerator.get_state_dict(model)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("accelerator")
    xla = notebook_launcher(train, (str(root / "xla"),), config=LaunchConfig(distributed_type="XLA"))
    cpu = notebook_launcher(train, (str(root / "cpu"),), num_processes=1, use_cpu=True)
    return root, xla, cpu


def test_training_on_xla_matches_cpu(runs):
    _, xla, cpu = runs
    assert xla["device"].startswith("xla") and xla["type"] == "XLA"
    assert xla["first"][-1] < xla["first"][0] / 5  # it learns
    assert torch.allclose(torch.tensor(xla["first"]), torch.tensor(cpu["first"]), rtol=1e-3, atol=1e-4)


def test_load_state_restores_training_exactly(runs):
    _, xla, _ = runs
    assert xla["after_load"] == pytest.approx(xla["after_save"], rel=1e-5)


def test_saved_files_load_on_cpu(runs):
    from safetensors.torch import load_file

    root, xla, _ = runs
    weights = load_file(str(root / "xla/model/model.safetensors"))
    assert set(weights) == set(xla["weights"])
    for name, tensor in weights.items():
        assert tensor.device.type == "cpu" and torch.equal(tensor, xla["weights"][name])
    assert torch.load(root / "xla/obj.pt")["note"].tolist() == [1.0, 2.0]
    assert xla["gathered"].tolist() == [3.0]


def test_accumulation_and_bf16_train_on_xla(tmp_path):
    result = notebook_launcher(train, (str(tmp_path / "acc"), 2, "bf16"), config=LaunchConfig(distributed_type="XLA"))
    assert result["first"][-1] < result["first"][0]


def _steps_without_a_device_loader():
    import torch_xla.debug.metrics as met

    from nbaccel import Accelerator

    accelerator = Accelerator()
    model, optimizer, _ = make_job()
    model, optimizer = accelerator.prepare(model, optimizer)  # no prepared loader: nothing else syncs
    x = torch.randn(8, 4, device=accelerator.device)
    syncs = []
    for _ in range(3):
        loss = model(x).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        syncs.append(met.counter_value("MarkStep") or 0)
    return syncs


def test_each_optimizer_step_ends_the_xla_graph():
    syncs = notebook_launcher(_steps_without_a_device_loader, config=LaunchConfig(distributed_type="XLA"))
    assert syncs[1] - syncs[0] >= 1 and syncs[2] - syncs[1] >= 1, syncs


def _reductions_per_step():
    import torch_xla.core.xla_model as xm

    from nbaccel import Accelerator

    calls = []
    real = xm.reduce_gradients
    xm.reduce_gradients = lambda optimizer, **kw: (calls.append(1), real(optimizer, **kw))[1]
    try:
        accelerator = Accelerator()
        model, optimizer, _ = make_job()
        model, optimizer = accelerator.prepare(model, optimizer)
        x = torch.randn(8, 4, device=accelerator.device)
        counts = []
        for _ in range(3):  # a plain loop: no accumulate()
            accelerator.backward(model(x).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
            counts.append(len(calls))
        return counts
    finally:
        xm.reduce_gradients = real


def test_every_optimizer_step_reduces_gradients_across_replicas():
    assert notebook_launcher(_reductions_per_step, config=LaunchConfig(distributed_type="XLA")) == [1, 2, 3]
