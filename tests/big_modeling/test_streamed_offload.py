"""Streamed offload on CPU: the same engine as on a GPU, with synchronous copies, driven by real
hooks on real models; outputs must be bit-identical to the plain offload path."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from nbaccel.big_modeling import cpu_offload, load_checkpoint_and_dispatch
from nbaccel.big_modeling.hooks import AlignDevicesHook
from nbaccel.big_modeling.streamed_offload import stream_offloaded
from nbaccel.errors import CheckpointError
from tests.big_modeling.helpers import (
    empty_model,
    make_model,
    sample_ids,
    save_checkpoint,
)

CPU = torch.device("cpu")
MAP = {"": "cpu", "blocks": "disk"}  # the blocks are read from the checkpoint's files


def _offload_hooks(model: nn.Module) -> list[tuple[AlignDevicesHook, list[str]]]:
    found = []
    for module in model.modules():
        hook = getattr(module, "_hf_hook", None)
        if isinstance(hook, AlignDevicesHook) and hook.offload and hook._names(module):
            found.append((hook, hook._names(module)))
    return found


def _streamed(model: nn.Module, slots: int = 2, cap: int = 2**30) -> list[AlignDevicesHook]:
    hooks = _offload_hooks(model)
    assert hooks
    plain = stream_offloaded(hooks, CPU, slots=slots, cap=cap)
    assert plain == []
    return [h for h, _ in hooks]


@pytest.mark.parametrize("slots", [1, 2, 3, 40])
def test_cpu_offloaded_model_streams_bit_identically(slots: int) -> None:
    reference = make_model()
    ids = sample_ids()
    with torch.no_grad():
        expected = reference(ids)
    model = cpu_offload(make_model(), "cpu")
    hooks = _streamed(model, slots=slots)
    with torch.no_grad():
        for _ in range(3):  # the second and third forwards start from the wrapped-around ring
            assert torch.equal(model(ids), expected)
    ring = hooks[0].streamed.offload.ring
    assert sum(b for b in ring.busy) == 0  # every acquired slot was released
    assert all(h.streamed.offload is hooks[0].streamed.offload for h in hooks)


def test_streams_under_inference_mode_too() -> None:
    ids = sample_ids()
    with torch.no_grad():
        expected = make_model()(ids)
    model = cpu_offload(make_model(), "cpu")
    _streamed(model)
    with torch.inference_mode():
        for _ in range(2):
            assert torch.equal(model(ids), expected)


def test_a_forward_that_raises_gives_its_slot_back() -> None:
    ids = sample_ids()
    with torch.no_grad():
        expected = make_model()(ids)
    model = cpu_offload(make_model(), "cpu")
    hooks = _streamed(model)
    ring = hooks[0].streamed.offload.ring
    for _ in range(ring.slots + 1):  # more failures than slots: none may stay busy
        with torch.no_grad(), pytest.raises(RuntimeError):
            model(ids.float())  # the embedding wants integer ids
    assert ring.busy == [0] * ring.slots and all(h._streaming == [] for h in hooks)
    assert model.embed.weight.device.type == "meta"
    with torch.no_grad():
        assert torch.equal(model(ids), expected)
    assert any(g is not None for g in ring.holds)  # still streaming


def test_without_streaming_a_failed_forward_unloads_the_weights_too() -> None:
    model = cpu_offload(make_model(), "cpu")
    with torch.no_grad(), pytest.raises(RuntimeError):
        model(sample_ids().float())
    assert model.embed.weight.device.type == "meta"


def test_pinned_copies_replace_the_loaders_tensors_once() -> None:
    model = cpu_offload(make_model(), "cpu")
    hooks = _streamed(model)
    loader = hooks[0].weights_map.dataset
    # the tied embedding/head weight is pinned once and shared
    assert loader.state_dict["embed.weight"] is loader.state_dict["head.weight"]
    members = [m for group in hooks[0].streamed.offload.engine.groups for m in group]
    assert all(m.direct is not None for m in members if m.nbytes)


def test_weights_over_the_cap_go_through_the_staging_ring() -> None:
    ids = sample_ids()
    with torch.no_grad():
        expected = make_model()(ids)
    model = cpu_offload(make_model(), "cpu")
    hooks = _streamed(model, cap=4096)  # room for a few small tensors only
    engine = hooks[0].streamed.offload.engine
    members = [m for group in engine.groups for m in group if m.nbytes]
    assert any(m.direct is None for m in members) and any(m.direct is not None for m in members)
    assert engine.staging is not None and engine.pool is not None
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(ids), expected)


def test_disk_offloaded_weights_are_read_by_reader_threads(tmp_path: os.PathLike) -> None:
    source = make_model()
    ckpt = save_checkpoint(source, tmp_path / "ckpt", shards=2)
    ids = sample_ids()
    with torch.no_grad():
        expected = source(ids)
    model = load_checkpoint_and_dispatch(empty_model(), ckpt, MAP)
    hooks = _streamed(model)
    engine = hooks[0].streamed.offload.engine
    assert all(m.info is not None for group in engine.groups for m in group if m.nbytes)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(ids), expected)


def test_a_cast_on_load_is_done_as_the_plain_path_does_it(tmp_path: os.PathLike) -> None:
    source = make_model()
    ckpt = save_checkpoint(source, tmp_path / "ckpt")
    ids = sample_ids()
    plain = load_checkpoint_and_dispatch(empty_model(), ckpt, MAP,
                                         dtype=torch.float64)
    with torch.no_grad():
        expected = plain(ids)
    model = load_checkpoint_and_dispatch(empty_model(), ckpt, MAP,
                                         dtype=torch.float64)
    hooks = _streamed(model)
    assert any(m.fetch is not None for g in hooks[0].streamed.offload.engine.groups for m in g)
    with torch.no_grad():
        assert torch.equal(model(ids), expected)


def test_with_gradients_enabled_hooks_take_the_plain_path() -> None:
    model = cpu_offload(make_model(), "cpu")
    hooks = _streamed(model)
    ring = hooks[0].streamed.offload.ring
    out = model(sample_ids())
    out.sum().backward()  # a slot view kept for the backward pass would be overwritten
    assert ring.holds == [None] * ring.slots
    assert all(h._streaming == [] for h in hooks)


def test_a_file_cut_short_after_dispatch_is_raised_in_the_forward(tmp_path: os.PathLike) -> None:
    source = make_model()
    ckpt = save_checkpoint(source, tmp_path / "ckpt")
    model = load_checkpoint_and_dispatch(empty_model(), ckpt, MAP)
    _streamed(model)
    size = os.path.getsize(ckpt)
    with open(ckpt, "r+b") as f:
        f.truncate(size // 2)
    with torch.no_grad(), pytest.raises(CheckpointError, match="truncated"):
        model(sample_ids())
    with torch.no_grad(), pytest.raises(CheckpointError, match="truncated"):
        model(sample_ids())  # the failed slot is copied again, and fails again, rather than used


def test_fewer_slots_when_the_device_is_short_of_memory(monkeypatch) -> None:
    from nbaccel.big_modeling import streamed_offload

    real = streamed_offload.SlotEngine.__init__
    room = {"slots": 2}

    def short(self, device, groups, slots, readers=4):
        if slots > room["slots"]:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        real(self, device, groups, slots, readers)

    monkeypatch.setattr(streamed_offload.SlotEngine, "__init__", short)
    ids = sample_ids()
    with torch.no_grad():
        expected = make_model()(ids)
    model = cpu_offload(make_model(), "cpu")
    with pytest.warns(UserWarning, match="only 2 of 3 offload slots fit"):
        stream_offloaded(_offload_hooks(model), CPU, slots=3, cap=2**30)
    hooks = _offload_hooks(model)
    assert hooks[0][0].streamed.offload.ring.slots == 2
    with torch.no_grad():
        assert torch.equal(model(ids), expected)
    room["slots"] = 1
    model = cpu_offload(make_model(), "cpu")
    with pytest.warns(UserWarning, match="no room for 2 offload slots"):
        plain = stream_offloaded(_offload_hooks(model), CPU, slots=3, cap=2**30)
    assert len(plain) == len(_offload_hooks(model)) and all(h.streamed is None for h in plain)
    with torch.no_grad():
        assert torch.equal(model(ids), expected)


def test_hooks_without_a_loader_are_left_plain() -> None:
    hook = AlignDevicesHook("cpu", offload=True, weights_map={"w": torch.ones(1)})
    assert stream_offloaded([(hook, ["w"])], CPU) == [hook]
    assert hook.streamed is None


def test_ctrl_c_during_a_staged_copy_never_lets_it_land_in_another_groups_slot() -> None:
    """Ctrl-C while the caller waits for a reader: the reader goes on, and before the fix its
    bytes landed over the next group copied into that slot (group 1 read group 0's values)."""
    import signal
    import threading
    import time

    from nbaccel.big_modeling.streamed_offload import Member, StreamedOffload

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    gate = threading.Event()

    def slow_zeros() -> torch.Tensor:  # a staged read still running when Ctrl-C comes
        time.sleep(0.3)  # the caller is waiting for this job by now
        os.kill(os.getpid(), signal.SIGINT)
        gate.wait(30)
        return torch.zeros(4)

    groups = [[Member("w", torch.float32, (4,), 16, fetch=slow_zeros)],
              [Member("w", torch.float32, (4,), 16, fetch=lambda: torch.ones(4))]]
    offload = StreamedOffload(CPU, groups, slots=1)  # group 1 must reuse group 0's slot
    try:
        with torch.no_grad(), pytest.raises(KeyboardInterrupt):
            offload.acquire(0)
        threading.Timer(0.5, gate.set).start()  # the interrupted read finishes later
        with torch.no_grad():
            weights = offload.acquire(1)["w"]
        offload.engine.close()  # every read has landed now
        assert weights.tolist() == [1.0] * 4
        offload.release(1)
    finally:
        gate.set()
        signal.signal(signal.SIGINT, previous)


def _pending_after_each_hook(model: nn.Module, loader) -> list[set[str]]:
    """The loader's background reads in flight right after each offloaded module ran."""
    seen: list[set[str]] = []
    for module in model.modules():
        if getattr(getattr(module, "_hf_hook", None), "offload", False):
            module.register_forward_hook(lambda *_: seen.append(set(loader._pending)))
    return seen


def test_the_loaders_prefetch_runs_with_gradients_and_only_then(tmp_path: os.PathLike) -> None:
    """With gradients a streamed hook loads the plain way, and its loader still reads the next
    module ahead; without, the ring prefetches and the loader must not read the same bytes again."""
    ckpt = save_checkpoint(make_model(), tmp_path / "ckpt")
    model = load_checkpoint_and_dispatch(empty_model(), ckpt, MAP)
    hooks = _streamed(model)
    loader = hooks[0].weights_map.dataset
    pending = _pending_after_each_hook(model, loader)
    with torch.no_grad():
        model(sample_ids())
    assert not any(pending)  # streamed: no second read of the same weights
    pending.clear()
    model(sample_ids()).sum().backward()
    assert any(pending)


def test_under_torch_compile_the_hooks_take_the_plain_path() -> None:
    ids = sample_ids()
    with torch.no_grad():
        expected = make_model()(ids)
    model = cpu_offload(make_model(), "cpu")
    hooks = _streamed(model)
    ring = hooks[0].streamed.offload.ring
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        assert torch.equal(compiled(ids), expected)
    assert ring.holds == [None] * ring.slots and ring.passes == 0  # traced code never streams
    with torch.no_grad():
        assert torch.equal(model(ids), expected)  # the model itself still streams
    assert ring.passes == 1
