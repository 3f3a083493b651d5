"""The one copy of the training tests' tiny models, data, and launch helper."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, Sampler, TensorDataset

import nbaccel

# torch 2.6 (the floor) runs FSDP2 on GPUs only: on CPU its all-gather calls Stream.record_event, which
# torch.cpu.Stream lacks there. Tests that train an FSDP2 model on CPU skip under such a torch.
cpu_fsdp2 = pytest.mark.skipif(
    not hasattr(torch.cpu.Stream, "record_event"),
    reason=f"FSDP2 cannot run on CPU under torch {torch.__version__} (no Stream.record_event)")


class TinyMLP(nn.Module):
    """4 -> 8 -> 1 regression MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class DropoutMLP(TinyMLP):
    """TinyMLP with dropout, so RNG state matters for resumed runs."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


class Block(nn.Module):
    """A residual block: the unit FSDP wraps by class name."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class BlockStack(nn.Module):
    """4 -> 8, three Blocks, 8 -> 1."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


class TiedLM(nn.Module):
    """An embedding whose weight the output head shares (tied weights)."""

    def __init__(self, vocab: int = 16, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def regression_data(n: int = 64, seed: int = 0) -> TensorDataset:
    """``n`` samples of ``y = x @ w + noise`` from a fixed seed."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


class CountingStream(IterableDataset):
    """An iterable dataset yielding ``0 .. n-1`` as 1-element tensors."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield torch.tensor([i])


class EpochShuffledStream(IterableDataset):
    """An iterable dataset yielding ``0 .. n-1`` (as 1-element tensors) in an order fixed by ``set_epoch``."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        for i in torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch)).tolist():
            yield torch.tensor([i])


class EpochRecordingSampler(Sampler[int]):
    """``0 .. n-1`` in order; remembers every epoch it is given (not a ``DistributedSampler``)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


class EpochRecordingDataset(Dataset):
    """Items ``0 .. n-1``; remembers every epoch it is given."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __getitem__(self, index: int) -> int:
        return index

    def __len__(self) -> int:
        return self.n


def model_and_optimizer(seed: int = 0, lr: float = 0.05, kind: type[nn.Module] = TinyMLP, momentum: float = 0.0
                        ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A freshly seeded model and its SGD optimizer."""
    torch.manual_seed(seed)
    model = kind()
    return model, torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)


def train_steps(accelerator: nbaccel.Accelerator, model: nn.Module, optimizer: Any, loader: Any,
                scheduler: Any = None) -> list[float]:
    """One pass over ``loader`` with accumulation; returns each batch's loss."""
    losses = []
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def flat_weights(model: nn.Module) -> torch.Tensor:
    """All parameters as one CPU vector."""
    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])


def launch(function: Callable[..., Any], num_processes: int, *args: Any, **kwargs: Any) -> dict[int, Any]:
    """Run ``function(*args)`` on ``num_processes`` CPU workers; returns ``{rank: result}``."""
    return nbaccel.notebook_launcher(function, args, num_processes=num_processes, use_cpu=True, return_all=True,
                                     timeout=120, **kwargs)


class ScaledStack(BlockStack):
    """A BlockStack whose output is multiplied by a buffer kept out of the state dict (``persistent=False``)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.tensor([0.5]), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


class Unresettable(nn.Module):
    """A model with a bare parameter: nothing can initialize it from the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight
