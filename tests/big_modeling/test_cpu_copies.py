"""Copies of checkpoint tensors made by the load's thread pool: the file's exact bytes (or the exact cast of
its values) in fresh, 64-byte aligned memory, whatever the chunking and the number of threads; a file that
goes away or shrinks is a CheckpointError naming it."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from pathlib import Path

import pytest
import torch

from nbaccel.big_modeling import cpu_copies, load_checkpoint_in_model
from nbaccel.big_modeling.checkpoint_files import (
    SAFETENSORS_DTYPES,
    SafetensorsFile,
    TensorInfo,
)
from nbaccel.big_modeling.cpu_copies import (
    MADV_POPULATE_WRITE,
    copy_threads,
    copy_to_cpu,
    populate,
)
from nbaccel.big_modeling.resident import FileMaps
from nbaccel.errors import CheckpointError
from tests.big_modeling.helpers import (
    empty_model,
    make_model,
    save_checkpoint,
    save_safetensors_at,
)
from tests.big_modeling.test_resident import _in_file_map, _misaligned_file


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    dtypes = [d for d in SAFETENSORS_DTYPES.values() if d.itemsize <= 8]
    return {f"t{i}": (torch.randn(n, generator=gen) * 100).to(dtype)
            for i, (n, dtype) in enumerate(zip([33, 1, 0, 2500, 17] * 3, dtypes))}


@pytest.mark.parametrize("data_start", [0, 8, 40])
@pytest.mark.parametrize("chunk_bytes,threads", [(7, 1), (64, 2), (1000, 3), (2**20, 2)])
def test_copies_are_the_files_exact_bytes_in_fresh_aligned_memory(tmp_path, data_start, chunk_bytes, threads):
    tensors = _tensors()
    save_safetensors_at(dict(list(tensors.items())[:8]), tmp_path / "a.safetensors", data_start)
    save_safetensors_at(dict(list(tensors.items())[8:]), tmp_path / "b.safetensors", data_start)
    infos = {**SafetensorsFile(tmp_path / "b.safetensors").tensors,
             **SafetensorsFile(tmp_path / "a.safetensors").tensors}
    names = sorted(infos, reverse=True)  # not file order: outputs still follow the request
    out = copy_to_cpu([infos[n] for n in names], threads=threads, chunk_bytes=chunk_bytes)
    for name, tensor in zip(names, out):
        expected = tensors[name]
        assert tensor.dtype == expected.dtype and tensor.shape == expected.shape
        assert torch.equal(tensor.view(torch.uint8), expected.view(torch.uint8)), name
        assert not _in_file_map(tensor, tmp_path) and tensor.data_ptr() % 64 == 0


@pytest.mark.parametrize("data_start", [0, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_casts_read_the_files_map_and_match_a_cast_of_the_stored_values(tmp_path, data_start, dtype):
    values = torch.randn(300, 70, generator=torch.Generator().manual_seed(3)) * 1e3
    values[0, :4] = torch.tensor([float("inf"), float("-inf"), 1e-30, 7e4])  # rounding at both ends
    path = tmp_path / "w.safetensors"
    save_safetensors_at({"w": values}, path, data_start)
    info = SafetensorsFile(path).tensors["w"]
    maps, viewed = FileMaps(), []

    def view(i: TensorInfo) -> torch.Tensor | None:
        mapped = maps.view(i)
        viewed.append(mapped is not None and _in_file_map(mapped, tmp_path))
        return mapped

    (cast,) = copy_to_cpu([info], [dtype], view=view, threads=2, chunk_bytes=4096)
    assert viewed == [True]  # read from the file's pages, not from a copy in float32
    assert cast.dtype == dtype and torch.equal(cast.view(torch.uint8), values.to(dtype).view(torch.uint8))
    assert not _in_file_map(cast, tmp_path)


def test_a_cast_of_a_tensor_that_splits_an_element_is_read_then_cast(tmp_path):
    path = tmp_path / "odd.safetensors"
    _misaligned_file(path)  # a float32 tensor at data byte 3: no float view of the file can hold it
    infos = SafetensorsFile(path).tensors
    assert FileMaps().view(infos["b"]) is None
    a, b = copy_to_cpu([infos["a"], infos["b"]], [torch.uint8, torch.float16], view=FileMaps().view)
    assert torch.equal(a, torch.tensor([7, 8, 9], dtype=torch.uint8))
    assert torch.equal(b, torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float16))


def _big_file(path: Path) -> TensorInfo:
    save_safetensors_at({"w": torch.arange(2**18, dtype=torch.float32)}, path, 8)
    return SafetensorsFile(path).tensors["w"]


def test_a_file_cut_short_before_the_copy_names_the_file(tmp_path):
    info = _big_file(tmp_path / "w.safetensors")
    os.truncate(info.path, info.offset + 100)
    with pytest.raises(CheckpointError) as caught:
        copy_to_cpu([info])
    assert caught.value.path == info.path and "truncated" in str(caught.value)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_file_that_shrinks_while_copying_names_the_file(tmp_path, threads):
    info = _big_file(tmp_path / "w.safetensors")
    small = tmp_path / "small.safetensors"
    save_safetensors_at({"s": torch.ones(4)}, small, 8)

    def shrink_then_view(i: TensorInfo) -> None:  # runs after the sizes were checked, before any read
        os.truncate(info.path, info.offset + info.nbytes // 2)

    with pytest.raises(CheckpointError) as caught:
        copy_to_cpu([SafetensorsFile(small).tensors["s"], info], [torch.float16, torch.float32],
                    view=shrink_then_view, threads=threads, chunk_bytes=2**16)
    assert caught.value.path == info.path and "truncated" in str(caught.value)
    assert "nbaccel-copy" not in {t.name.split("_")[0] for t in threading.enumerate()}


def test_a_file_removed_after_its_header_was_read_names_the_file(tmp_path):
    info = _big_file(tmp_path / "w.safetensors")
    os.remove(info.path)
    with pytest.raises(CheckpointError) as caught:
        copy_to_cpu([info])
    assert caught.value.path == info.path and "removed" in str(caught.value)


def test_populate_write_brings_the_pages_in_before_the_copy():
    probe = mmap.mmap(-1, mmap.PAGESIZE)
    if not populate(ctypes.addressof(ctypes.c_char.from_buffer(probe)), 1, MADV_POPULATE_WRITE):
        pytest.skip("this kernel is older than 5.14: no MADV_POPULATE_WRITE")
    raw = mmap.mmap(-1, 64 * mmap.PAGESIZE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(raw))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    vec = (ctypes.c_ubyte * 64)()

    def resident() -> int:
        assert libc.mincore(ctypes.c_void_p(address), len(raw), vec) == 0
        return sum(v & 1 for v in bytes(vec))

    assert resident() == 0
    assert populate(address + 10, 5 * mmap.PAGESIZE, MADV_POPULATE_WRITE)  # kernels since 5.14
    assert resident() == 6  # whole pages, rounded outwards
    assert raw[:] == bytes(len(raw))  # faulted in, not written


def test_a_kernel_without_populate_still_copies_the_right_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_copies, "MADV_POPULATE_WRITE", 0x7FFF)  # advice the kernel refuses (EINVAL)
    monkeypatch.setattr(cpu_copies, "MADV_POPULATE_READ", 0x7FFF)
    assert not populate(torch.empty(10).data_ptr(), 40, cpu_copies.MADV_POPULATE_WRITE)
    info = _big_file(tmp_path / "w.safetensors")
    (copy,) = copy_to_cpu([info], threads=2, chunk_bytes=2**16)
    (cast,) = copy_to_cpu([info], [torch.float64], view=FileMaps().view, threads=2, chunk_bytes=2**16)
    assert torch.equal(copy, torch.arange(2**18, dtype=torch.float32))
    assert torch.equal(cast, torch.arange(2**18, dtype=torch.float64))


def test_the_copy_uses_the_cpus_this_process_may_run_on():
    assert copy_threads() == min(len(os.sched_getaffinity(0)), cpu_copies.MAX_THREADS)


@pytest.mark.parametrize("data_start", [8, 0])
def test_a_loaded_model_in_another_dtype_matches_its_cast_and_writes_stay_in_memory(tmp_path, data_start):
    folder = tmp_path / "ckpt"
    full = make_model()
    save_checkpoint(full, folder, "safetensors", shards=2, data_start=data_start)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    model = empty_model()
    load_checkpoint_in_model(model, folder, device_map={"": "cpu"}, dtype=torch.bfloat16)
    for name, tensor in full.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor.to(torch.bfloat16)), name
        assert not _in_file_map(model.state_dict()[name], folder)
    assert model.head.weight is model.embed.weight
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.fill_(3)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


@pytest.mark.parametrize("threads", [1, 3])
def test_progress_is_each_tensors_stored_bytes_and_drawn_in_the_callers_thread(tmp_path, threads):
    tensors = _tensors()
    save_safetensors_at(tensors, tmp_path / "a.safetensors", 8)
    infos = list(SafetensorsFile(tmp_path / "a.safetensors").tensors.values())
    dtypes = [torch.float64 if i.dtype.is_floating_point else i.dtype for i in infos]  # casts too
    reported, lock, waits = [0] * len(infos), threading.Lock(), []

    def report(k: int, n: int) -> None:
        with lock:
            reported[k] += n

    copy_to_cpu(infos, dtypes, view=FileMaps().view, threads=threads, chunk_bytes=64,
                on_piece=report, on_wait=lambda: waits.append(threading.current_thread()))
    assert reported == [i.nbytes for i in infos]  # in the file's bytes, whatever the cast
    assert waits and set(waits) == {threading.current_thread()}
