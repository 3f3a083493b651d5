"""Check, on a real TPU runtime, what torch_xla's CPU runtime cannot test: collectives across replicas.

Run it on a Colab / Kaggle TPU runtime or a TPU VM (``python scripts/check_tpu.py``, or ``%run`` it
from a notebook cell). It launches one replica per XLA device through ``notebook_launcher`` and
checks, in every replica: the Accelerator's rank, world size and device; ``gather``, ``reduce``,
``broadcast``, ``pad_across_processes``, ``gather_object``, ``broadcast_object_list``;
``wait_for_everyone`` as a real rendezvous; the dataloader giving each replica its own shard
through ``MpDeviceLoader``; one optimizer step matching the full-batch step (gradients averaged
across replicas); ``save_state`` writing one checkpoint that loads back; and, where each replica
has a process of its own (TPU v4 and later), torchrun's variables; that replicas start from rank
0's weights, that gradient accumulation steps at an epoch's end, that ``gather_for_metrics``
drops an uneven dataset's padding, and that an ``IterableDataset`` loader feeds every replica.
Then, from the notebook's side: ``set_seed`` between launches leaves the XLA runtime alone,
back-to-back launches, a relaunch right after an interrupt, ``hang_timeout`` stopping a silent
rank, and ``num_processes=8`` running every device. It prints one line per check and exits
non-zero if any failed; about two minutes on a v2-8/v3-8 or a v5e.

Without a TPU it makes a dry run on one CPU-runtime replica (that checks the script, not the
collectives).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from nbaccel import Accelerator

CHECKS: list[tuple[str, Callable[..., object]]] = []


def check(name: str) -> Callable[[Callable[..., object]], Callable[..., object]]:
    def register(function: Callable[..., object]) -> Callable[..., object]:
        CHECKS.append((name, function))
        return function
    return register


@check("accelerator sees its replica")
def _identity(acc: Accelerator, rank: int, world: int, folder: str) -> None:
    assert (acc.process_index, acc.num_processes) == (rank, world), \
        f"Accelerator says rank {acc.process_index} of {acc.num_processes}, torch_xla says {rank} of {world}"
    import torch_xla

    assert acc.device == torch_xla.device(), f"Accelerator device {acc.device} != this replica's {torch_xla.device()}"


@check("gather")
def _gather(acc: Accelerator, rank: int, world: int, folder: str) -> None:
    got = acc.gather(torch.tensor([float(rank)], device=acc.device)).cpu().tolist()
    assert got == [float(r) for r in range(world)], got


@check("reduce sum and mean")
def _reduce(acc: Accelerator, rank: int, world: int, folder: str) -> None:
    total = acc.reduce(torch.tensor([rank + 1.0], device=acc.device), "sum").cpu().item()
    mean = acc.reduce(torch.tensor([rank + 1.0], device=acc.device), "mean").cpu().item()
    assert total == world * (world + 1) / 2 and abs(mean - (world + 1) / 2) < 1e-6, (total, mean)


@check("broadcast from rank 0")
def _broadcast(acc: Accelerator, rank: int, world: int, folder: str) -> None:
    from nbaccel.ops import broadcast

    got = broadcast(torch.tensor([rank + 10.0], device=acc.device), from_process=0).cpu().item()
    assert got == 10.0, got


@check("pad_across_processes")
def _pad(acc: Accelerator, rank: int, world: int, folder: str) -> None:
    padded = acc.pad_across_processes(torch.ones(rank + 1, device=acc.device), dim=0)
    assert padded.shape[0] == world and padded.cpu().sum().item() == rank + 1, padded


@check("gather_object and broadcast_object_list")
def _objects(acc: Accelerator, rank: int, world: int, folder: str) -> None:
    from nbaccel.ops import broadcast_object_list, gather_object

    assert gather_object([f"r{rank}"]) == [f"r{r}" for r in range(world)]
    assert broadcast_object_list([f"from {rank}"], from_process=0) == ["from 0"]


@check("wait_for_everyone is a rendezvous")
def _barrier(acc: Accelerator, rank: int, world: int, folder: str) -> None:
    if rank == 0:
        time.sleep(2.0)
    started = time.monotonic()
    acc.wait_for_everyone()
    waited = time.monotonic() - started
    assert rank == 0 or world == 1 or waited > 1.0, f"rank {rank} passed the barrier after {waited:.2f}s"


@check("replicas start from rank 0's weights")
def _initial_weights(acc: Accelerator, rank: int, world: int, folder: str) -> None:
    torch.manual_seed(rank)  # replica threads (v2/v3) share one CPU generator anyway: seeding cannot align them
    model = acc.prepare(torch.nn.Linear(5, 5))
    mine = acc.unwrap_model(model).weight.detach()
    everyone = acc.gather(mine[None]).cpu()
    assert all(torch.equal(everyone[0], w) for w in everyone), "replicas hold different weights after prepare"


@check("dataloader shards and gradient all-reduce")
def _training(acc: Accelerator, rank: int, world: int, folder: str) -> None:
    from torch.utils.data import DataLoader, TensorDataset

    draw = torch.Generator().manual_seed(0)  # private: the global one is shared by replica threads
    x, y = torch.randn(8 * world, 3, generator=draw), torch.randn(8 * world, generator=draw)
    reference = torch.nn.Linear(3, 1)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(1, 3, generator=draw))
        reference.bias.copy_(torch.randn(1, generator=draw))
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


@check("accumulation steps at the epoch's end (10 batches, 4 per step)")
def _accumulation(acc: Accelerator, rank: int, world: int, folder: str) -> None:
    from torch.utils.data import DataLoader, TensorDataset

    acc.gradient_accumulation_steps = 4
    try:
        model = torch.nn.Linear(1, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        loader = DataLoader(TensorDataset(torch.arange(20.0 * world)[:, None]), batch_size=2)
        model, optimizer, loader = acc.prepare(model, optimizer, loader)
        for epoch in range(2):
            syncs, ends = [], []
            for i, (xb,) in enumerate(loader, 1):
                with acc.accumulate(model):
                    acc.backward(model(xb).pow(2).mean())
                    optimizer.step()
                    optimizer.zero_grad()
                    syncs += [i] if acc.sync_gradients else []
                    ends += [i] if acc.gradient_state.end_of_dataloader else []
            assert syncs == [4, 8, 10] and ends == [10], f"epoch {epoch}: steps after {syncs}, end flagged at {ends}"
            left = sum(float(p.grad.abs().sum().cpu()) for p in model.parameters() if p.grad is not None)
            assert left == 0.0, f"gradients spilled past epoch {epoch}'s end"
    finally:
        acc.gradient_accumulation_steps = 1


@check("gather_for_metrics drops an uneven dataset's padding")
def _gather_for_metrics(acc: Accelerator, rank: int, world: int, folder: str) -> None:
    from torch.utils.data import DataLoader, TensorDataset

    n = 4 * world + 2  # the last global batch is short
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(float(n))), batch_size=4))
    seen = [v for (xb,) in loader for v in acc.gather_for_metrics(xb).cpu().tolist()]
    assert sorted(seen) == [float(i) for i in range(n)], seen


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.arange(40.0))


@check("IterableDataset loader gives every replica batches")
def _iterable(acc: Accelerator, rank: int, world: int, folder: str) -> None:
    from torch.utils.data import DataLoader

    loader = acc.prepare(DataLoader(_Stream(), batch_size=4))
    mine = torch.cat([xb.cpu() for xb in loader])
    assert len(mine), "no batches"
    everyone = acc.gather(mine.to(acc.device)).cpu().tolist()
    assert set(everyone) == {float(i) for i in range(40)}, sorted(set(everyone))


@check("save_state once, load_state back")
def _checkpoint(acc: Accelerator, rank: int, world: int, folder: str) -> None:
    model = acc.prepare(torch.nn.Linear(2, 2))
    acc.save_state(folder)
    acc.wait_for_everyone()
    before = acc.get_state_dict(model)
    with torch.no_grad():
        acc.unwrap_model(model).weight.zero_()
    acc.load_state(folder)
    assert torch.equal(acc.get_state_dict(model)["weight"], before["weight"])


@check("torchrun variables in a process of its own")
def _environment(acc: Accelerator, rank: int, world: int, folder: str) -> None:
    from nbaccel.launch.xla.launcher import current_replica

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


def _where() -> int:
    import torch_xla.runtime as xr

    return xr.global_ordinal()


def _sleeps(seconds: float) -> int:
    time.sleep(seconds)
    return 0


def _rank_0_goes_silent(seconds: float) -> int:
    import torch_xla.runtime as xr

    if xr.global_ordinal() == 0:
        time.sleep(seconds)
    return xr.global_ordinal()


def notebook_checks(world: int) -> dict[str, str]:
    """What a notebook does between launches, checked from this (the notebook's) process."""
    import _thread
    import threading

    from nbaccel import notebook_launcher, set_seed
    from nbaccel.errors import LaunchTimeoutError
    from nbaccel.hardware import xla_runtime_initialized

    outcome: dict[str, str] = {}

    def run(name: str, function: Callable[[], None]) -> None:
        started = time.monotonic()
        try:
            function()
            outcome[name] = "ok"
        except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt too: every check is reported
            outcome[name] = f"{type(exc).__name__}: {exc}"
        print(f"check_tpu: {name}: {time.monotonic() - started:.1f}s", file=sys.stderr)

    def set_seed_between_launches() -> None:
        set_seed(0)
        assert not xla_runtime_initialized(), "set_seed started the XLA runtime in the notebook"
        assert sorted(notebook_launcher(_where, return_all=True)) == list(range(world))

    def back_to_back() -> None:
        for _ in range(3):
            assert sorted(notebook_launcher(_where, return_all=True)) == list(range(world))

    def relaunch_after_interrupt() -> None:
        timer = threading.Timer(5.0, _thread.interrupt_main)
        timer.start()
        try:
            notebook_launcher(_sleeps, (120.0,))
            raise AssertionError("the interrupt did not stop the launch")
        except KeyboardInterrupt:
            pass
        finally:
            timer.cancel()
        assert sorted(notebook_launcher(_where, return_all=True)) == list(range(world)), "the TPU was still busy"

    def hang_timeout() -> None:
        if world == 1:
            return  # the watchdog needs a rank that finished
        started = time.monotonic()
        try:
            notebook_launcher(_rank_0_goes_silent, (120.0,), hang_timeout=10.0)
            raise AssertionError("a silent rank 0 was not stopped")
        except LaunchTimeoutError as exc:
            assert exc.reason == "hang", exc.reason
        took = time.monotonic() - started
        assert took < 60, f"stopped after {took:.0f}s for hang_timeout=10"

    def num_processes_8() -> None:
        cpu_runtime = os.environ.get("PJRT_DEVICE") == "CPU"  # the dry run: the CPU runtime runs any count
        ran = notebook_launcher(_where, num_processes=8, return_all=True)
        assert sorted(ran) == list(range(8 if cpu_runtime else world)), f"ran {len(ran)} replicas"

    run("set_seed between launches leaves the runtime alone", set_seed_between_launches)
    run("back-to-back launches", back_to_back)
    run("relaunch right after an interrupt", relaunch_after_interrupt)
    run("hang_timeout stops a silent rank", hang_timeout)
    run("num_processes=8 runs every device", num_processes_8)
    return outcome


def main() -> int:
    from nbaccel import notebook_launcher
    from nbaccel.hardware import tpu_detected

    on_tpu = tpu_detected()
    if not on_tpu:
        print("check_tpu: no TPU here; dry run on one replica of torch_xla's CPU runtime", file=sys.stderr)
        os.environ.setdefault("PJRT_DEVICE", "CPU")
        os.environ["CPU_NUM_DEVICES"] = "1"
        os.environ["NBACCEL_TPU"] = "1"
    folder = tempfile.mkdtemp(prefix="nbaccel-check-tpu-")
    started = time.monotonic()
    results = notebook_launcher(run_checks, (folder,), return_all=True, timeout=600)
    failed = 0
    print(f"\n{len(results)} replicas, in-replica checks took {time.monotonic() - started:.0f}s")
    for name, _ in CHECKS:
        bad = {rank: out[name] for rank, out in sorted(results.items()) if out[name] != "ok"}
        failed += bool(bad)
        print(f"{'FAIL' if bad else 'ok  '}  {name}")
        for rank, error in list(bad.items())[:4]:
            print(f"        rank {rank}: {error}")
    for name, outcome in notebook_checks(len(results)).items():
        failed += outcome != "ok"
        print(f"{'FAIL' if outcome != 'ok' else 'ok  '}  {name}")
        if outcome != "ok":
            print(f"        {outcome}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
