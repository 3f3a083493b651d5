"""Resident weights: CPU weights are the checkpoint's own pages (copy-on-write), released with
the model; staged reads give the file's exact bytes; launched workers share the pages."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import struct
from pathlib import Path

import pytest
import safetensors.torch
import torch

from nbaccel import notebook_launcher
from nbaccel.big_modeling import load_checkpoint_and_dispatch, load_checkpoint_in_model
from nbaccel.big_modeling.checkpoint_files import SAFETENSORS_DTYPES, SafetensorsFile
from nbaccel.big_modeling.resident import FileMaps, read_to_device
from nbaccel.errors import CheckpointError
from tests.big_modeling.helpers import (
    TinyLM,
    empty_model,
    make_model,
    sample_ids,
    save_checkpoint,
    save_safetensors_at,
)


def _maps_of(folder: Path) -> list[tuple[int, int]]:
    """Address ranges of this process's memory maps of files in ``folder``."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith(str(folder)):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            ranges.append((lo, hi))
    return ranges


def _fds_of(folder: Path) -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(folder)):
            found.append(target)
    return found


def _in_file_map(tensor: torch.Tensor, folder: Path) -> bool:
    ptr = tensor.data_ptr()
    return any(lo <= ptr < hi for lo, hi in _maps_of(folder))


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _plain(checkpoint_folder: Path, kind: str) -> TinyLM:
    """The model as a plain ``load_state_dict`` of every shard gives it."""
    model = TinyLM().eval()
    state = {}
    for path in checkpoint_folder.iterdir():
        if path.suffix == ".safetensors":
            state.update(safetensors.torch.load_file(path))
        elif path.suffix == ".bin":
            state.update(torch.load(path, weights_only=True))
    model.load_state_dict(state, strict=False)  # head.weight is tied to embed.weight
    return model


@pytest.mark.parametrize("kind", ["safetensors", "bin"])
@pytest.mark.parametrize("data_start", [0, 8, None])
def test_loaded_outputs_are_bit_identical_to_a_plain_load_state_dict(tmp_path, kind, data_start):
    folder = tmp_path / "ckpt"
    save_checkpoint(make_model(), folder, kind, shards=3, data_start=data_start)
    model = load_checkpoint_and_dispatch(empty_model(), folder, {"": "cpu"})
    plain = _plain(folder, kind)
    one = sample_ids()[:1, :1]  # batch-1 linear layers: where MKL's results depend on alignment
    with torch.no_grad():
        assert torch.equal(model(sample_ids()), plain(sample_ids()))
        assert torch.equal(model(one), plain(one))
    for name, tensor in plain.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_cpu_weights_are_the_files_pages_not_copies(tmp_path):
    folder = tmp_path / "ckpt"
    save_checkpoint(make_model(), folder, "safetensors", shards=2, data_start=0)
    model = empty_model()
    load_checkpoint_in_model(model, folder, device_map={"": "cpu"})
    for name, tensor in model.state_dict().items():
        assert _in_file_map(tensor, folder), f"{name} was copied out of the checkpoint"
    assert model.head.weight is model.embed.weight  # the tied alias is one tensor still
    assert not _fds_of(folder)  # mapped files keep no descriptor open


def test_a_file_whose_data_is_off_the_allocators_alignment_is_copied(tmp_path):
    folder = tmp_path / "ckpt"
    save_checkpoint(make_model(), folder, "safetensors", data_start=8)
    model = load_checkpoint_and_dispatch(empty_model(), folder, {"": "cpu"})
    assert not any(_in_file_map(t, folder) for t in model.state_dict().values())
    assert all(t.data_ptr() % 64 == 0 for t in model.state_dict().values())


def test_a_dtype_change_copies_and_matches_a_cast_of_the_stored_values(tmp_path):
    folder = tmp_path / "ckpt"
    full = make_model()
    save_checkpoint(full, folder, "safetensors")
    model = empty_model()
    load_checkpoint_in_model(model, folder, device_map={"": "cpu"}, dtype=torch.float16)
    assert model.blocks[0].up.weight.dtype == torch.float16
    assert not _in_file_map(model.blocks[0].up.weight, folder)
    assert torch.equal(model.blocks[0].up.weight, full.blocks[0].up.weight.half())


@pytest.mark.parametrize("kind,data_start", [("safetensors", 0), ("safetensors", 8), ("bin", None)])
def test_writing_to_a_loaded_weight_never_touches_the_checkpoint(tmp_path, kind, data_start):
    folder = tmp_path / "ckpt"
    full = make_model()
    save_checkpoint(full, folder, kind, shards=2, data_start=data_start)
    before = _digest(folder)
    model = load_checkpoint_and_dispatch(empty_model(), folder, {"": "cpu"})
    with torch.no_grad():
        reference = model(sample_ids())
        for tensor in model.state_dict().values():
            tensor.mul_(2) if tensor.is_floating_point() else tensor.zero_()
        assert not torch.equal(model(sample_ids()), reference)  # the writes took
    assert _digest(folder) == before
    again = load_checkpoint_and_dispatch(empty_model(), folder, {"": "cpu"})
    with torch.no_grad():
        assert torch.equal(again(sample_ids()), reference)


def test_the_maps_go_away_with_the_model(tmp_path):
    folder = tmp_path / "ckpt"
    save_checkpoint(make_model(), folder, "safetensors", shards=3, data_start=0)
    model = load_checkpoint_and_dispatch(empty_model(), folder, {"": "cpu"})
    assert len(_maps_of(folder)) == 3  # one map per shard, however many tensors it holds
    with torch.no_grad():
        model(sample_ids())
    del model
    gc.collect()
    assert _maps_of(folder) == [] and _fds_of(folder) == []


def _misaligned_file(path: Path) -> None:
    """A uint8 tensor of 3 bytes, then a float32 one at data byte 3: a view cannot express it."""
    floats = struct.pack("<4f", 1.0, 2.0, 3.0, 4.0)
    header = json.dumps({"a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
                         "b": {"dtype": "F32", "shape": [4], "data_offsets": [3, 19]}}).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes([7, 8, 9]) + floats)


def test_a_misaligned_tensor_is_copied_with_the_right_values(tmp_path):
    path = tmp_path / "odd.safetensors"
    _misaligned_file(path)
    infos = SafetensorsFile(path).tensors
    maps = FileMaps()
    assert torch.equal(maps.tensor(infos["a"]), torch.tensor([7, 8, 9], dtype=torch.uint8))
    b = maps.tensor(infos["b"])
    assert torch.equal(b, torch.tensor([1.0, 2.0, 3.0, 4.0])) and not _in_file_map(b, tmp_path)


def test_a_file_cut_short_after_its_header_was_read_names_the_file(tmp_path):
    path = tmp_path / "w.safetensors"
    safetensors.torch.save_file({"a": torch.ones(1024)}, path)
    info = SafetensorsFile(path).tensors["a"]
    os.truncate(path, info.offset + 100)
    for load in (lambda: FileMaps().tensor(info), lambda: read_to_device([info], "cpu")):
        with pytest.raises(CheckpointError) as caught:
            load()
        assert caught.value.path == str(path) and "truncated" in str(caught.value)


@pytest.mark.parametrize("buffer_bytes,buffers", [(7, 1), (64, 2), (1000, 3), (2**20, 2)])
def test_staged_reads_are_the_files_exact_bytes_in_any_chunking(tmp_path, buffer_bytes, buffers):
    gen = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": (torch.randn(n, generator=gen) * 100).to(dtype)
               for i, (n, dtype) in enumerate(zip([33, 1, 0, 250, 17] * 3, [
                   d for d in SAFETENSORS_DTYPES.values() if d.itemsize <= 8]))}
    safetensors.torch.save_file(dict(list(tensors.items())[:8]), tmp_path / "a.safetensors")
    safetensors.torch.save_file(dict(list(tensors.items())[8:]), tmp_path / "b.safetensors")
    infos = {**SafetensorsFile(tmp_path / "b.safetensors").tensors,
             **SafetensorsFile(tmp_path / "a.safetensors").tensors}
    names = sorted(infos, reverse=True)  # not file order: outputs still follow the request
    out = read_to_device([infos[n] for n in names], "cpu", buffer_bytes, buffers)
    for name, tensor in zip(names, out):
        expected = tensors[name]
        assert tensor.dtype == expected.dtype and tensor.shape == expected.shape
        assert torch.equal(tensor.view(torch.uint8), expected.view(torch.uint8)), name


def _total_pss() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no Pss line in /proc/self/smaps_rollup")


def _pss_worker(folder: str) -> dict[str, int]:
    """Load the whole model, use it, and report what it costs this process (PSS, not RSS)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    before = _total_pss()
    model = load_checkpoint_and_dispatch(empty_model(width=1024), folder, {"": "cpu"})
    with torch.no_grad():
        model(sample_ids())
        for tensor in model.state_dict().values():
            tensor.sum()  # every page touched
    dist.barrier()  # every worker holds the model while each one measures
    rss = pss = 0
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split(maxsplit=1)[0]
        if "-" in first and not first.endswith(":"):
            inside = line.split()[-1].startswith(folder)
        elif inside and first in ("Rss:", "Pss:"):
            kib = int(line.split()[1]) * 1024
            rss, pss = (rss + kib, pss) if first == "Rss:" else (rss, pss + kib)
    added = _total_pss() - before
    dist.barrier()
    del model
    dist.destroy_process_group()
    return {"rss": rss, "pss": pss, "added": added}


def test_launched_workers_share_the_checkpoints_pages(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    folder = tmp_path / "ckpt"
    save_checkpoint(make_model(width=1024), folder, "safetensors", shards=2, data_start=0)
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    results = notebook_launcher(_pss_worker, (str(folder),), num_processes=2, return_all=True,
                                timeout=120)
    rss = sum(r["rss"] for r in results.values())
    pss = sum(r["pss"] for r in results.values())
    assert rss >= 1.9 * size  # each worker maps (and has touched) the whole model ...
    assert pss <= 1.05 * size + 2 * 2**16  # ... but together they hold one copy of it
    # the whole processes: one model plus some MiB of interpreter noise each; copies would be 2.5x
    assert sum(r["added"] for r in results.values()) <= 1.8 * size


def _rss_of_maps(path: Path) -> int:
    rss, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split(maxsplit=1)[0]
        if "-" in first and not first.endswith(":"):
            inside = line.split()[-1] == str(path)
        elif inside and first == "Rss:":
            rss += int(line.split()[1]) * 1024
    return rss


@pytest.mark.parametrize("kernel_has_populate_read", [True, False])
def test_mapped_pages_are_in_place_before_the_first_use(tmp_path, monkeypatch,
                                                         kernel_has_populate_read):
    from nbaccel.big_modeling import resident

    if not kernel_has_populate_read:  # advice the kernel refuses (EINVAL): readahead instead
        monkeypatch.setattr(resident, "_MADV_POPULATE_READ", 0x7FFF)
    path = tmp_path / "w.safetensors"
    values = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
    save_safetensors_at({"w": values}, path, 0)
    tensor = FileMaps().tensor(SafetensorsFile(path).tensors["w"])
    if kernel_has_populate_read:  # the forward pass will not fault these pages in
        assert _rss_of_maps(path) >= values.nbytes
    assert torch.equal(tensor, values)


def test_only_the_pages_of_mapped_tensors_are_brought_in(tmp_path):
    path = tmp_path / "w.safetensors"
    resident, offloaded = torch.ones(256, 1024), torch.zeros(1024, 1024)  # 1 MiB and 4 MiB
    save_safetensors_at({"resident": resident, "offloaded": offloaded}, path, 0)
    tensor = FileMaps().tensor(SafetensorsFile(path).tensors["resident"])
    assert resident.nbytes <= _rss_of_maps(path) < resident.nbytes + 2 * 2**16
    assert torch.equal(tensor, resident)
