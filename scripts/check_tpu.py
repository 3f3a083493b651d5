"""Check, on a real TPU runtime, what torch_xla's CPU runtime cannot test: collectives across replicas.

Run it on a Colab / Kaggle TPU runtime or a TPU VM (``python scripts/check_tpu.py``, or ``%run`` it
from a notebook cell). It launches one replica per XLA device through ``notebook_launcher`` and
checks, in every replica: the Accelerator's rank, world size and device; ``gather``, ``reduce``,
``broadcast``, ``pad_across_processes``, ``gather_object``, ``broadcast_object_list``;
``wait_for_everyone`` as a real rendezvous; the dataloader giving each replica its own shard
through ``MpDeviceLoader``; one optimizer step matching the full-batch step (gradients averaged
across replicas); ``save_state`` writing one checkpoint that loads back; and, where each replica
has a process of its own (TPU v4 and later), torchrun's variables. It prints one line per check
and exits non-zero if any failed.

Without a TPU it makes a dry run on one CPU-runtime replica (that checks the script, not the
collectives).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable

import torch

CHECKS: list[tuple[str, Callable[..., object]]] = []


def check(name: str) -> Callable[[Callable[..., object]], Callable[..., object]]:
    def register(function: Callable[..., object]) -> Callable[..., object]:
        CHECKS.append((name, function))
        return function
    return register


@check("accelerator sees its replica")
def _identity(acc, rank: int, world: int, folder: str) -> None:
    assert (acc.process_index, acc.num_processes) == (rank, world), \
        f"Accelerator says rank {acc.process_index} of {acc.num_processes}, torch_xla says {rank} of {world}"
    import torch_xla

    assert acc.device == torch_xla.device(), f"Accelerator device {acc.device} != this replica's {torch_xla.device()}"


@check("gather")
def _gather(acc, rank: int, world: int, folder: str) -> None:
    got = acc.gather(torch.tensor([float(rank)], device=acc.device)).cpu().tolist()
    assert got == [float(r) for r in range(world)], got


@check("reduce sum and mean")
def _reduce(acc, rank: int, world: int, folder: str) -> None:
    total = acc.reduce(torch.tensor([rank + 1.0], device=acc.device), "sum").cpu().item()
    mean = acc.reduce(torch.tensor([rank + 1.0], device=acc.device), "mean").cpu().item()
    assert total == world * (world + 1) / 2 and abs(mean - (world + 1) / 2) < 1e-6, (total, mean)


@check("broadcast from rank 0")
def _broadcast(acc, rank: int, world: int, folder: str) -> None:
    from nbaccel.ops import broadcast

    got = broadcast(torch.tensor([rank + 10.0], device=acc.device), from_process=0).cpu().item()
    assert got == 10.0, got


@check("pad_across_processes")
def _pad(acc, rank: int, world: int, folder: str) -> None:
    padded = acc.pad_across_processes(torch.ones(rank + 1, device=acc.device), dim=0)
    assert padded.shape[0] == world and padded.cpu().sum().item() == rank + 1, padded


@check("gather_object and broadcast_object_list")
def _objects(acc, rank: int, world: int, folder: str) -> None:
    from nbaccel.ops import broadcast_object_list, gather_object

    assert gather_object([f"r{rank}"]) == [f"r{r}" for r in range(world)]
    assert broadcast_object_list([f"from {rank}"], from_process=0) == ["from 0"]


@check("wait_for_everyone is a rendezvous")
def _barrier(acc, rank: int, world: int, folder: str) -> None:
    if rank == 0:
        time.sleep(2.0)
    started = time.monotonic()
    acc.wait_for_everyone()
    waited = time.monotonic() - started
    assert rank == 0 or world == 1 or waited > 1.0, f"rank {rank} passed the barrier after {waited:.2f}s"


@check("dataloader shards and gradient all-reduce")
def _training(acc, rank: int, world: int, folder: str) -> None:
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    x, y = torch.randn(8 * world, 3), torch.randn(8 * world)
    reference = torch.nn.Linear(3, 1)
    model = torch.nn.Linear(3, 1)
    model.load_state_dict(reference.state_dict())
    torch.nn.functional.mse_loss(reference(x).squeeze(-1), y).backward()
    with torch.no_grad():
        expected = reference.weight - 0.1 * reference.weight.grad
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.arange(8.0 * world)[:, None], y), batch_size=8)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    (index, yb), = list(loader)
    seen = acc.gather(index.squeeze(-1)).cpu().sort().values
    assert seen.tolist() == list(range(8 * world)), f"replicas together saw {seen.tolist()}"
    xb = x[index.squeeze(-1).long().cpu()].to(acc.device)
    acc.backward(torch.nn.functional.mse_loss(model(xb).squeeze(-1), yb))
    optimizer.step()
    got = model.weight.detach().cpu()
    assert torch.allclose(got, expected, atol=1e-5), f"weights {got.tolist()} != full-batch step {expected.tolist()}"


@check("save_state once, load_state back")
def _checkpoint(acc, rank: int, world: int, folder: str) -> None:
    model = acc.prepare(torch.nn.Linear(2, 2))
    acc.save_state(folder)
    acc.wait_for_everyone()
    before = acc.get_state_dict(model)
    with torch.no_grad():
        acc.unwrap_model(model).weight.zero_()
    acc.load_state(folder)
    assert torch.equal(acc.get_state_dict(model)["weight"], before["weight"])


@check("torchrun variables in a process of its own")
def _environment(acc, rank: int, world: int, folder: str) -> None:
    from nbaccel.launch.xla import current_replica

    info = current_replica()
    if info is not None and not info.shares_process and world > 1:
        assert os.environ.get("RANK") == str(rank) and os.environ.get("WORLD_SIZE") == str(world)


def run_checks(folder: str) -> dict[str, str]:
    """In every replica: run each check, return ``{name: "ok" | error}``."""
    import torch_xla.runtime as xr

    from nbaccel import Accelerator

    rank, world = xr.global_ordinal(), xr.world_size()
    acc = Accelerator()
    outcome = {}
    for name, function in CHECKS:
        try:
            function(acc, rank, world, folder)
            outcome[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - every check is reported, the others still run
            outcome[name] = f"{type(exc).__name__}: {exc}"
    return outcome


def main() -> int:
    from nbaccel import notebook_launcher
    from nbaccel.environment import tpu_detected

    on_tpu = tpu_detected()
    if not on_tpu:
        print("check_tpu: no TPU here; dry run on one replica of torch_xla's CPU runtime", file=sys.stderr)
        os.environ.setdefault("PJRT_DEVICE", "CPU")
        os.environ["CPU_NUM_DEVICES"] = "1"
        os.environ["NBACCEL_TPU"] = "1"
    folder = tempfile.mkdtemp(prefix="nbaccel-check-tpu-")
    results = notebook_launcher(run_checks, (folder,), return_all=True, timeout=600)
    failed = 0
    print(f"\n{len(results)} replicas")
    for name, _ in CHECKS:
        bad = {rank: out[name] for rank, out in sorted(results.items()) if out[name] != "ok"}
        failed += bool(bad)
        print(f"{'FAIL' if bad else 'ok  '}  {name}")
        for rank, error in list(bad.items())[:4]:
            print(f"        rank {rank}: {error}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
