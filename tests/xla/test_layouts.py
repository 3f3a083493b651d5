"""Training on both TPU layouts: one replica per process, and replicas as threads of one process.

``process``: one replica, alone in its process (TPU v4 and later run one such process per chip;
the CPU runtime runs one). ``threads``: ``CPU_NUM_DEVICES=2``, two replicas as threads of one
process, as on Colab's and Kaggle's TPU v2-8 / v3-8. On the thread layout the collectives are
carried by :mod:`tests.xla.thread_collectives` (the CPU runtime aborts real ones; see there);
nbaccel's own calls run unchanged.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

pytest.importorskip("torch_xla")

import torch

from nbaccel import notebook_launcher
from nbaccel.config import LaunchConfig
from nbaccel.errors import LaunchTimeoutError

pytestmark = pytest.mark.xla

XLA = LaunchConfig(distributed_type="XLA")


@pytest.fixture(params=["process", "threads"])
def replicas(request, devices) -> int:
    """How many replicas the layout runs (1 in its own process, or 2 threads of one process)."""
    return devices(1 if request.param == "process" else 2)


def launch(function, *args, **kwargs):
    return notebook_launcher(function, args, config=XLA, return_all=True, **kwargs)


def _start(**kwargs):
    """In each replica: carry collectives among threads, and build the Accelerator."""
    from nbaccel import Accelerator
    from tests.xla.thread_collectives import install

    calls = install()
    return Accelerator(**kwargs), calls


# --------------------------------------------------------------------------- initial weights


def initial_weights():
    import torch_xla.runtime as xr

    accelerator, calls = _start()
    torch.manual_seed(xr.global_ordinal())  # threads share one CPU generator: seeding alone cannot align them
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    model[1].running_mean.fill_(float(xr.global_ordinal()))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model = accelerator.prepare(model)
    after = {k: v.cpu() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    return before, after, calls["collective_broadcast", xr.global_ordinal()]


def test_every_replica_starts_from_rank_0s_weights(replicas):
    results = launch(initial_weights)
    assert sorted(results) == list(range(replicas))
    rank0_before = results[0][0]
    for rank, (_before, after, broadcasts) in results.items():
        for name, value in after.items():
            assert torch.equal(value, rank0_before[name]), f"rank {rank}'s {name} is not rank 0's after prepare"
        assert broadcasts == (1 if replicas > 1 else 0)
    if replicas > 1:  # without the broadcast they would have started apart
        assert not torch.equal(results[1][0]["0.weight"], rank0_before["0.weight"])


# --------------------------------------------------------------------------- accumulation across epochs


def accumulate_10_batches_by_4():
    """Each replica reads 10 batches per epoch, accumulating 4: steps at batches 4, 8 and 10 (the epoch's end)."""
    from torch.utils.data import DataLoader, TensorDataset

    accelerator, _ = _start(gradient_accumulation_steps=4)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(torch.arange(20.0 * accelerator.num_processes)[:, None]), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    epochs = []
    for _ in range(2):
        seen = []
        for (xb,) in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(xb).pow(2).mean())
                optimizer.step()
                optimizer.zero_grad()
                state = loader.state_dict()
                seen.append((accelerator.sync_gradients, accelerator.gradient_state.end_of_dataloader,
                             state["iteration"], state["in_progress"]))
        leftover = sum(float(p.grad.abs().sum().cpu()) for p in model.parameters() if p.grad is not None)
        epochs.append((seen, leftover))
    return epochs


def test_accumulation_steps_at_each_epoch_end(replicas):
    results = launch(accumulate_10_batches_by_4)
    for rank, epochs in results.items():
        for epoch, (seen, leftover) in enumerate(epochs):
            assert len(seen) == 10
            syncs = [i + 1 for i, (sync, *_) in enumerate(seen) if sync]
            assert syncs == [4, 8, 10], f"rank {rank} epoch {epoch}: optimizer stepped after batches {syncs}"
            ends = [i + 1 for i, (_, end, *_) in enumerate(seen) if end]
            assert ends == [10], f"rank {rank} epoch {epoch}: end_of_dataloader after batches {ends}"
            assert {(it, busy) for *_, it, busy in seen} == {(epoch, True)}, f"epoch {epoch}'s pass ended early"
            assert leftover == 0.0, f"rank {rank}: gradients spilled past the end of epoch {epoch}"


def save_mid_epoch_and_resume(folder: str):
    """Save after 5 of 10 batches, finish the pass, load, skip 5: the rest of the same pass must follow."""
    from torch.utils.data import DataLoader, TensorDataset

    accelerator, _ = _start()
    model = accelerator.prepare(torch.nn.Linear(1, 1))
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(20.0 * accelerator.num_processes)),
                                            batch_size=2, shuffle=True))
    original = []
    for i, (xb,) in enumerate(loader, 1):
        original.append(xb.cpu().tolist())
        if i == 5:
            accelerator.save_state(folder)
    accelerator.load_state(folder)
    resumed = [xb.cpu().tolist() for (xb,) in accelerator.skip_first_batches(loader, 5)]
    return original, resumed, model is not None


def test_a_mid_epoch_checkpoint_resumes_where_it_was_saved(replicas, tmp_path):
    results = launch(save_mid_epoch_and_resume, str(tmp_path / "ckpt"))
    for rank, (original, resumed, _) in results.items():
        assert len(original) == 10
        assert resumed == original[5:], f"rank {rank} resumed with {resumed}, not {original[5:]}"


# --------------------------------------------------------------------------- gather_for_metrics


def gather_uneven():
    from torch.utils.data import DataLoader, TensorDataset

    accelerator, _ = _start()
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(10.0)), batch_size=4))
    seen = []
    for (xb,) in loader:
        seen += accelerator.gather_for_metrics(xb).cpu().tolist()
    return seen


def test_gather_for_metrics_drops_the_padding_of_an_uneven_dataset(replicas):
    results = launch(gather_uneven)
    for rank, seen in results.items():
        assert sorted(seen) == [float(i) for i in range(10)], f"rank {rank} gathered {seen}"


# --------------------------------------------------------------------------- IterableDataset


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(torch.arange(10.0))


def iterable_batches():
    from torch.utils.data import DataLoader

    accelerator, _ = _start()
    loader = accelerator.prepare(DataLoader(Stream(), batch_size=2))
    mine = [xb.cpu().tolist() for xb in loader]
    return mine, str(loader.device) if hasattr(loader, "device") else None


def test_iterable_dataset_gives_every_replica_its_batches(replicas):
    results = launch(iterable_batches)
    together = []
    for rank, (mine, _) in results.items():
        assert mine, f"rank {rank} got no batches"
        together += [v for batch in mine for v in batch]
    assert sorted(set(together)) == [float(i) for i in range(10)]


# --------------------------------------------------------------------------- the notebook between launches


def where():
    import torch_xla.runtime as xr

    return xr.global_ordinal()


def test_set_seed_between_launches_leaves_the_runtime_alone(replicas):
    from nbaccel import set_seed
    from nbaccel.hardware import xla_runtime_initialized

    assert sorted(launch(where)) == list(range(replicas))
    set_seed(0)  # a notebook cell after a TPU launch
    assert not xla_runtime_initialized()
    assert sorted(launch(where)) == list(range(replicas))


def sleeps(seconds: float):
    time.sleep(seconds)
    return os.getpid()


def test_back_to_back_launches_and_a_relaunch_after_an_interrupt(replicas):
    import _thread

    for _ in range(3):
        assert sorted(launch(where)) == list(range(replicas))
    timer = threading.Timer(2.0, _thread.interrupt_main)
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            launch(sleeps, 60.0)
    finally:
        timer.cancel()
    assert time.monotonic() - started < 20
    again = launch(where)  # at once: nothing of the interrupted launch is left to get in the way
    assert sorted(again) == list(range(replicas))


def test_the_launch_returns_only_once_its_processes_are_gone(replicas):
    pids = launch(sleeps, 0.0)  # each replica's process id (the host's, for one replica)
    assert os.getpid() not in pids.values()
    assert not [pid for pid in pids.values() if _alive(pid)], "a replica process outlived the launch"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# --------------------------------------------------------------------------- hang_timeout


def rank_0_goes_silent(seconds: float):
    import torch_xla.runtime as xr

    if xr.global_ordinal() == 0:
        time.sleep(seconds)
    return xr.global_ordinal()


def test_hang_timeout_stops_a_silent_rank_at_the_asked_time(devices):
    devices(2)
    started = time.monotonic()
    with pytest.raises(LaunchTimeoutError) as info:
        launch(rank_0_goes_silent, 60.0, hang_timeout=2.0)
    took = time.monotonic() - started
    assert info.value.reason == "hang" and 2.0 <= took < 15, took
    assert 0 in info.value.stacks and "ranks [0] made no progress for 2s after ranks [1] finished" in str(info.value)


def test_hang_timeout_none_spares_a_slow_rank(devices):
    devices(2)
    assert launch(rank_0_goes_silent, 4.0, hang_timeout=None) == {0: 0, 1: 1}
