"""What the fault tests share: a training state with one of every kind of file, and snapshots of it."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

import nbaccel
from tests.training.helpers import model_and_optimizer, regression_data


class Counter:
    """A user object registered for checkpointing (``custom_checkpoint_0.pkl``)."""

    def __init__(self, count: int = 0) -> None:
        self.count = count

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


class Trainer:
    """An Accelerator with a model, an SGD optimizer with momentum, a scheduler, a dataloader, an fp16
    scaler and a registered counter: ``save_state`` writes every file ``load_state`` can read."""

    def __init__(self, seed: int = 0, mixed_precision: str = "fp16") -> None:
        self.accelerator = nbaccel.Accelerator(mixed_precision=mixed_precision)
        model, optimizer = model_and_optimizer(seed=seed, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        loader = DataLoader(regression_data(16), batch_size=4, shuffle=True)
        self.counter = Counter()
        self.accelerator.register_for_checkpointing(self.counter)
        self.model, self.optimizer, self.loader, self.scheduler = self.accelerator.prepare(
            model, optimizer, loader, scheduler)

    def train(self, steps: int = 2) -> None:
        for _, (x, y) in zip(range(steps), self.loader):
            loss = torch.nn.functional.mse_loss(self.model(x), y)
            self.accelerator.backward(loss)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad()
            self.counter.count += 1

    def snapshot(self) -> dict[str, Any]:
        """Everything a load could change, copied."""
        return copy.deepcopy({"model": self.accelerator.unwrap_model(self.model).state_dict(),
                              "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                              "count": self.counter.count})


def assert_same(a: Any, b: Any) -> None:
    """Equal nested state dicts, tensors compared exactly."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif torch.is_tensor(a):
        assert torch.equal(a, b)
    else:
        assert a == b


class WritesMarker:
    """A pickle that, once unpickled, creates a file: the proof that loading ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


def plant(path: Path, marker: Path) -> None:
    """Replace ``path`` with a pickle that creates ``marker`` when loaded without ``weights_only``."""
    torch.save({"state": WritesMarker(marker)}, path)
