"""Training throughput: nbaccel's Accelerator against Accelerate's and hand-written DDP.

One launch of ``--processes`` CPU workers (gloo). In each worker the same small MLP trains on
the same data three ways, in interleaved rounds (hand-written DDP, nbaccel, Accelerate, the
starting one rotating), so machine noise hits all three alike. Per implementation we report the median
steps/s over rounds, and the ratios to hand-written DDP.

Run: ``.venv/bin/python benchmarks/train.py`` (needs ``pip install accelerate`` for its column).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import nbaccel


def make_model(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def make_data(steps: int, batch_size: int, world: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    n = steps * batch_size * world
    return TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g))


def _loop(model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader,
          backward: Callable[[torch.Tensor], None]) -> tuple[int, float]:
    loss_fn = nn.CrossEntropyLoss()
    steps = 0
    dist.barrier()
    start = time.perf_counter()
    for x, y in loader:
        loss = loss_fn(model(x), y)
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
    dist.barrier()
    return steps, time.perf_counter() - start


def run_ddp(data: TensorDataset, width: int, batch_size: int) -> tuple[int, float]:
    model = nn.parallel.DistributedDataParallel(make_model(width))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(data, batch_size=batch_size, sampler=DistributedSampler(data, shuffle=False))
    return _loop(model, optimizer, loader, lambda loss: loss.backward())


def run_nbaccel(data: TensorDataset, width: int, batch_size: int) -> tuple[int, float]:
    accelerator = nbaccel.Accelerator()
    model = make_model(width)
    model, optimizer, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01),
                                                   DataLoader(data, batch_size=batch_size))
    return _loop(model, optimizer, loader, accelerator.backward)


def run_accelerate(data: TensorDataset, width: int, batch_size: int) -> tuple[int, float]:
    import accelerate

    accelerator = accelerate.Accelerator(cpu=True)
    model = make_model(width)
    model, optimizer, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01),
                                                   DataLoader(data, batch_size=batch_size))
    return _loop(model, optimizer, loader, accelerator.backward)


def worker(steps: int, width: int, batch_size: int, rounds: int) -> dict[str, list[float]]:
    """Runs in every rank: interleaved rounds of each implementation; returns steps/s per round."""
    torch.set_num_threads(1)
    nbaccel.Accelerator()  # joins the gloo group the launch describes
    data = make_data(steps, batch_size, dist.get_world_size())
    runners = {"hand-written DDP": run_ddp, "nbaccel": run_nbaccel}
    if importlib.util.find_spec("accelerate") is not None:
        runners["Accelerate"] = run_accelerate
    for runner in runners.values():  # warm-up: first-use costs (dynamo import, allocator) out of the figures
        runner(make_data(5, batch_size, dist.get_world_size()), width, batch_size)
    rates: dict[str, list[float]] = {name: [] for name in runners}
    names = list(runners)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotate who goes first
            done, seconds = runners[name](data, width, batch_size)
            rates[name].append(done / seconds)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    args = parser.parse_args()
    rates = nbaccel.notebook_launcher(worker, (args.steps, args.width, args.batch_size, args.rounds),
                                      num_processes=args.processes, use_cpu=True, timeout=900)
    base = statistics.median(rates["hand-written DDP"])
    print(f"{args.processes} CPU processes (gloo), MLP 64-{args.width}-{args.width}-10, "
          f"batch {args.batch_size}/process, "
          f"{args.steps} steps x {args.rounds} interleaved rounds; torch {torch.__version__}")
    print(f"{'implementation':<18} {'median steps/s':>14} {'min':>8} {'max':>8} {'vs DDP':>8} {'paired':>8}")
    for name, values in rates.items():
        med = statistics.median(values)
        paired = statistics.median(v / d for v, d in zip(values, rates["hand-written DDP"]))
        print(f"{name:<18} {med:14.1f} {min(values):8.1f} {max(values):8.1f} {med / base:8.3f} {paired:8.3f}")
    print("(paired: median over rounds of the ratio to hand-written DDP in the same round)")
    if "Accelerate" in rates:
        ratio = statistics.median(a / b for a, b in zip(rates["nbaccel"], rates["Accelerate"]))
        print(f"nbaccel / Accelerate (paired): {ratio:.3f}")
    else:
        print("Accelerate is not installed (pip install accelerate) - its column is missing")


if __name__ == "__main__":
    main()
