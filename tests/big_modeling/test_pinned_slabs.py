"""Host memory for copies to a GPU: exact sizes, page-locked by registration, given back, and a
refusal that falls back to pageable memory. The CUDA runtime's two calls (``cudaHostRegister``,
``cudaHostUnregister``) are recorded by a stand-in; the memory, the copies and the engine are real."""

from __future__ import annotations

import gc
import logging
import threading

import pytest
import torch

from nbaccel.big_modeling import (
    cpu_offload,
    load_checkpoint_and_dispatch,
    pinned_slabs,
    slot_engine,
    streamed_offload,
)
from nbaccel.big_modeling.hook_attach import remove_hook_from_submodules
from nbaccel.big_modeling.pinned_slabs import host_buffer, pin_tensors, pinned_bytes, unpin
from tests.big_modeling.helpers import empty_model, make_model, sample_ids, save_checkpoint
from tests.big_modeling.test_streamed_offload import MAP, _streamed


class RecordingRuntime:
    """``torch.cuda.cudart()``'s host-registration calls, recorded; ``refuse`` makes them fail
    as the driver does (an error code), or as torch's allocator does (a RuntimeError)."""

    def __init__(self, refuse: str | None = None) -> None:
        self.refuse, self.registered, self.unregistered = refuse, {}, []

    def cudaHostRegister(self, address: int, size: int, flags: int) -> int:  # CUDA's name
        if self.refuse == "code":
            return 2  # cudaErrorMemoryAllocation
        if self.refuse == "raise":
            raise RuntimeError("CUDA error: out of memory")
        self.registered[address] = size
        return 0

    def cudaHostUnregister(self, address: int) -> int:
        if address in self.registered:  # (memory an earlier test locked may go now too)
            assert address not in self.unregistered, "unregistered twice"
            self.unregistered.append(address)
        return 0

    def cudaGetErrorString(self, code: int) -> str:
        return "out of memory"

    def locked(self) -> int:
        return sum(s for a, s in self.registered.items() if a not in self.unregistered)


@pytest.fixture
def runtime(monkeypatch) -> RecordingRuntime:
    fake = RecordingRuntime()
    monkeypatch.setattr(pinned_slabs, "_cudart", lambda: fake)
    return fake


def test_a_staging_buffer_is_locked_at_exactly_its_size(runtime) -> None:
    nbytes = 3 * 5 * 2**20 + 1  # torch's pinned allocator would lock the next power of two: 32 MiB
    buffer = host_buffer(nbytes, pin=True)
    assert buffer.numel() == nbytes and list(runtime.registered.values()) == [nbytes]
    buffer[-1] = 7
    assert pinned_bytes([buffer[10:20]]) == nbytes


def test_memory_is_unregistered_when_its_last_view_goes_and_not_before(runtime) -> None:
    buffer = host_buffer(2**20, pin=True)
    view = buffer[100:200]
    del buffer
    gc.collect()
    assert runtime.unregistered == []  # a view still uses it
    view.fill_(3)
    del view
    gc.collect()
    assert runtime.locked() == 0 and len(runtime.unregistered) == 1


@pytest.mark.parametrize("refuse", ["code", "raise"])
def test_a_refused_registration_falls_back_to_pageable_memory(monkeypatch, refuse: str) -> None:
    monkeypatch.setattr(pinned_slabs, "_cudart", lambda: RecordingRuntime(refuse))
    with pytest.warns(RuntimeWarning, match="could not page-lock 1.0 MiB .*out of memory"):
        buffer = host_buffer(2**20, pin=True)
    buffer.fill_(1)
    assert pinned_bytes([buffer]) == 0 and int(buffer.sum()) == 2**20
    with pytest.warns(RuntimeWarning, match="could not page-lock"):
        out = pin_tensors([torch.arange(10.0)], cap=2**20, pin=True)
    assert out[0].tolist() == list(range(10))


def test_slabs_are_copied_on_several_threads_registered_once_each_and_logged(runtime, caplog) -> None:
    tensors = [torch.randn(2**18) for _ in range(6)]  # 1 MiB each
    seen, together = set(), threading.Barrier(2, timeout=60)
    real = torch.Tensor.copy_

    def watched(self, *args, **kwargs):  # waits for a second copier once
        name = threading.current_thread().name
        if name.startswith("nbaccel-pin") and name not in seen:
            seen.add(name)
            together.wait()  # passes only if two threads copy at the same time
        return real(self, *args, **kwargs)

    with caplog.at_level(logging.INFO, logger=pinned_slabs.__name__), \
            pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "copy_", watched)
        out = pin_tensors(tensors, cap=2**30, pin=True, slab_bytes=2**21, threads=2)
    assert all(torch.equal(a, b) for a, b in zip(tensors, out))
    assert sorted(runtime.registered.values()) == [2**21] * 3  # exact: two tensors per slab
    assert len(seen) == 2
    assert any("pinned 6.0 MiB of offloaded weights in 3 slab(s) on 2 thread(s) in" in r.message
               and "page-locked" in r.message for r in caplog.records)
    assert unpin(out) == 6 * 2**20 and runtime.locked() == 0
    assert torch.equal(out[0], tensors[0])  # still valid, now pageable


def _pinning_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the CPU engine ask for page-locked memory, as on a GPU (``pin=self.cuda``)."""
    monkeypatch.setattr(slot_engine, "host_buffer", lambda n, pin: host_buffer(n, pin=True))
    monkeypatch.setattr(streamed_offload, "pin_tensors",
                        lambda tensors, cap, pin: pin_tensors(tensors, cap, pin=True))


@pytest.mark.parametrize("release", ["remove_hooks", "delete_model"])
def test_a_streamed_model_gives_its_locked_memory_back(monkeypatch, runtime, release: str) -> None:
    _pinning_engine(monkeypatch)
    source = make_model()
    ids = sample_ids()
    with torch.no_grad():
        expected = source(ids)
    model = cpu_offload(make_model(), "cpu")
    engine = _streamed(model, cap=4096)[0].streamed.offload.engine  # some pinned, some staged
    staging, direct = engine.staging, [m.direct for g in engine.groups for m in g if m.direct is not None]
    assert runtime.registered.get(staging.data_ptr()) == staging.numel() == 2 * engine.slot_bytes
    assert pinned_bytes(direct) > 0 and runtime.locked() == pinned_bytes([staging, *direct])
    with torch.no_grad():
        assert torch.equal(model(ids), expected)
    del engine, staging, direct
    if release == "remove_hooks":
        remove_hook_from_submodules(model)
    else:
        del model
        gc.collect()  # a hooked module refers to itself through its forward: freed by the collector
    assert runtime.locked() == 0
    assert not [t.name for t in threading.enumerate() if t.name.startswith("nbaccel-offload")]
    if release == "remove_hooks":  # its weights are back in it, in memory no longer locked
        with torch.no_grad():
            assert torch.equal(model(ids), expected)


def test_a_streamed_model_whose_memory_cannot_be_locked_still_runs(tmp_path, monkeypatch) -> None:
    _pinning_engine(monkeypatch)
    monkeypatch.setattr(pinned_slabs, "_cudart", lambda: RecordingRuntime("raise"))
    source = make_model()
    ckpt = save_checkpoint(source, tmp_path)
    model = load_checkpoint_and_dispatch(empty_model(), ckpt, MAP)
    with pytest.warns(RuntimeWarning, match="could not page-lock"):
        hooks = _streamed(model, cap=4096)
    assert hooks[0].streamed is not None  # streamed from pageable memory, not given up
    ids = sample_ids()
    with torch.no_grad():
        assert torch.equal(model(ids), source(ids))


def test_a_forked_childs_writes_to_host_memory_stay_its_own() -> None:
    import os

    buffer = host_buffer(2**20, pin=False)  # e.g. a staging ring when a notebook forks its workers
    buffer.fill_(1)
    pid = os.fork()
    if pid == 0:
        buffer.fill_(9)
        os._exit(0)
    os.waitpid(pid, 0)
    assert int(buffer.sum()) == 2**20
