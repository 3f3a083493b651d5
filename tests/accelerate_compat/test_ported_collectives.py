"""The ported names that talk across processes, in two CPU processes over gloo: Accelerate and nbaccel agree.

Each function below runs in launched workers, once importing ``accelerate`` and once ``nbaccel``.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from tests.training.helpers import launch, model_and_optimizer, regression_data

pytest.importorskip("accelerate")


def _fresh(library: str):
    lib = importlib.import_module(library)
    if library == "accelerate":  # its process-wide singletons survive fork; nbaccel's workers start fresh
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    return lib


def copied(library: str) -> dict:
    lib = _fresh(library)
    utils = importlib.import_module(f"{library}.utils")
    state = lib.PartialState(cpu=True)
    tensor = torch.arange(6, dtype=torch.float64).reshape(2, 3) if state.process_index == 1 else None
    return {"copy": utils.copy_tensor_to_devices(tensor)}


def test_copy_tensor_to_devices_matches():
    ours, theirs = launch(copied, 2, "nbaccel"), launch(copied, 2, "accelerate")
    for rank in (0, 1):
        assert torch.equal(ours[rank]["copy"], theirs[rank]["copy"])
        assert ours[rank]["copy"].dtype == torch.float64 and ours[rank]["copy"].shape == (2, 3)


def copied_by_both(library: str) -> str:
    from nbaccel.errors import DistributedOperationError
    from nbaccel.utils import copy_tensor_to_devices

    lib = _fresh(library)
    lib.PartialState(cpu=True)
    try:
        copy_tensor_to_devices(torch.ones(1))
    except DistributedOperationError as exc:
        return exc.operation
    return "no error"


def test_copy_tensor_to_devices_refuses_a_tensor_on_every_process():
    assert launch(copied_by_both, 2, "nbaccel") == {0: "copy_tensor_to_devices", 1: "copy_tensor_to_devices"}


def uneven(library: str, override: bool) -> dict:
    """Train on 5 samples over 2 ranks without evening them out: by the override, or by the Accelerator's setting."""
    lib = _fresh(library)
    config = lib.DataLoaderConfiguration(even_batches=override)
    accelerator = lib.Accelerator(cpu=True, dataloader_config=config)
    torch.manual_seed(0)
    model, optimizer = model_and_optimizer()
    loader = DataLoader(regression_data(5), batch_size=1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    batches = 0
    with accelerator.join_uneven_inputs([model], even_batches=False if override else None):
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            batches += 1
    weights = torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(model).parameters()])
    return {"batches": batches, "weights": weights, "even_after": loader.batch_sampler.even_batches}


def test_join_uneven_inputs_trains_uneven_ranks_on_cpu_too():
    """A documented difference: Accelerate joins only on accelerators (on CPU its ranks fall out of step)."""
    ours = launch(uneven, 2, "nbaccel", False)
    assert [ours[r]["batches"] for r in (0, 1)] == [3, 2]
    torch.testing.assert_close(ours[0]["weights"], ours[1]["weights"])  # the ranks stayed in sync
    with pytest.raises(RuntimeError, match=r"closed|Connection"):  # Accelerate: no Join on MULTI_CPU
        launch(uneven, 2, "accelerate", False)
    # even_batches=False for the block only: the same training, and the loaders' setting comes back
    overridden = launch(uneven, 2, "nbaccel", True)
    assert [overridden[r]["batches"] for r in (0, 1)] == [3, 2] and overridden[0]["even_after"] is True
    torch.testing.assert_close(overridden[0]["weights"], ours[0]["weights"])
    # Accelerate 1.16 sets the override on the batch sampler, but its loader still pads rank 1 to
    # 3 batches; nbaccel's loader follows the override.
    assert [b["batches"] for b in launch(uneven, 2, "accelerate", True).values()] == [3, 3]


def triggered(library: str) -> dict:
    lib = _fresh(library)
    accelerator = lib.Accelerator(cpu=True)
    torch.manual_seed(0)
    model, optimizer = model_and_optimizer()
    model, optimizer = accelerator.prepare(model, optimizer)
    x, y = regression_data(4)[accelerator.process_index * 2:accelerator.process_index * 2 + 2]
    with accelerator.no_sync(model):
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        local = [p.grad.clone() for p in model.parameters()]
        optimizer.zero_grad()
        with accelerator.trigger_sync_in_backward(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
    return {"local": torch.cat([g.flatten() for g in local]),
            "synced": torch.cat([p.grad.flatten() for p in model.parameters()])}


def test_trigger_sync_in_backward_averages_gradients_inside_no_sync():
    ours, theirs = launch(triggered, 2, "nbaccel"), launch(triggered, 2, "accelerate")
    for rank in (0, 1):
        torch.testing.assert_close(ours[rank]["synced"], theirs[rank]["synced"])
    assert not torch.allclose(ours[0]["local"], ours[1]["local"])
    torch.testing.assert_close(ours[0]["synced"], ours[1]["synced"])
    torch.testing.assert_close(ours[0]["synced"], (ours[0]["local"] + ours[1]["local"]) / 2)


def compressed(library: str, hook: str) -> list[float]:
    lib = _fresh(library)
    utils = importlib.import_module(f"{library}.utils")
    handler = utils.DistributedDataParallelKwargs(comm_hook=utils.DDPCommunicationHookType(hook))
    accelerator = lib.Accelerator(cpu=True, kwargs_handlers=[handler])
    torch.manual_seed(0)
    model, optimizer = model_and_optimizer()
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(regression_data(16), batch_size=2))
    losses = []
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses + [float(p.sum()) for p in model.parameters()]


def test_ddp_communication_hooks_match():
    for hook in ("fp16", "power_sgd"):  # bf16 needs NCCL
        ours, theirs = launch(compressed, 2, "nbaccel", hook), launch(compressed, 2, "accelerate", hook)
        assert ours[0] == pytest.approx(theirs[0], abs=1e-6) and ours[1] == pytest.approx(theirs[1], abs=1e-6)
    plain, fp16 = launch(compressed, 2, "nbaccel", "no"), launch(compressed, 2, "nbaccel", "fp16")
    assert plain[0] != fp16[0]  # the hook took effect (fp16 rounding changes the weights)


def saved_once(library: str, folder: str) -> list[str]:
    lib = _fresh(library)
    utils = importlib.import_module(f"{library}.utils")
    state = lib.PartialState(cpu=True)
    utils.save({"rank": state.process_index}, Path(folder) / f"{library}.pt")
    state.wait_for_everyone()
    return sorted(p.name for p in Path(folder).iterdir())


def test_save_writes_from_the_main_process_only(tmp_path):
    for library in ("nbaccel", "accelerate"):
        launch(saved_once, 2, library, str(tmp_path))
        assert torch.load(tmp_path / f"{library}.pt") == {"rank": 0}


def dispatched(library: str) -> list:
    lib = _fresh(library)
    lib.PartialState(cpu=True)
    loader = importlib.import_module(f"{library}.data_loader").DataLoaderDispatcher(list(range(12)), batch_size=2)
    return [b.tolist() for b in loader]


def test_a_data_loader_dispatcher_built_by_hand_matches():
    ours, theirs = launch(dispatched, 2, "nbaccel"), launch(dispatched, 2, "accelerate")
    assert ours == theirs
    assert ours[0] == [[0, 1], [4, 5], [8, 9]] and ours[1] == [[2, 3], [6, 7], [10, 11]]
