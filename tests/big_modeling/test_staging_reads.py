"""Disk-offloaded weights read into staging by every reader at once: a group's bytes are split
over the readers, exactly, and a file cut short is raised with no read left running."""

from __future__ import annotations

import os
import threading

import pytest
import safetensors.torch
import torch

from nbaccel.big_modeling import load_checkpoint_and_dispatch
from nbaccel.big_modeling.checkpoint_files import SafetensorsFile
from nbaccel.big_modeling.staging_reads import SplitReads, pieces
from nbaccel.errors import CheckpointError
from tests.big_modeling.helpers import empty_model, make_model, sample_ids, save_checkpoint
from tests.big_modeling.test_streamed_offload import MAP, _streamed


def test_a_groups_weights_are_read_by_several_readers_at_once(tmp_path, monkeypatch) -> None:
    source = make_model(width=1024, blocks=2)  # each block's up and down weights: 8 MiB, 2 pieces
    ckpt = save_checkpoint(source, tmp_path)
    model = load_checkpoint_and_dispatch(empty_model(width=1024, blocks=2), ckpt, MAP)
    _streamed(model, slots=3)
    ids = sample_ids()
    with torch.no_grad():
        expected = source(ids)
    weight = SafetensorsFile(ckpt).tensors["blocks.0.up.weight"]
    reads, real, together = [], os.preadv, threading.Barrier(2, timeout=30)
    lock = threading.Lock()

    def watched(fd: int, buffers: list, offset: int) -> int:  # records who reads what, then reads
        name = threading.current_thread().name
        with lock:
            first_two = weight.offset <= offset < weight.offset + weight.nbytes and \
                len(reads) < 2 and name not in {n for n, _ in reads}
            if first_two:
                reads.append((name, offset))
        if first_two:
            together.wait()  # passes only when a second thread reads the same weight meanwhile
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", watched)
    with torch.no_grad():
        assert torch.equal(model(ids), expected)
    monkeypatch.undo()
    assert len(reads) == 2 and len({at for _, at in reads}) == 2, reads  # two pieces, two threads


@pytest.mark.parametrize("piece_bytes", [1, 7, 4096, 2**20])
def test_split_reads_put_every_byte_in_place(tmp_path, piece_bytes: int) -> None:
    tensors = {f"t{i}": torch.randint(0, 255, (n,), dtype=torch.uint8) for i, n in
               enumerate([1, 4095, 10_000, 0, 333])}
    path = tmp_path / "w.safetensors"
    safetensors.torch.save_file(tensors, str(path))
    infos = SafetensorsFile(path).tensors
    outs = {k: torch.full((t.numel(),), 7, dtype=torch.uint8) for k, t in tensors.items()}
    reads = SplitReads(3, piece_bytes)
    try:
        reads.read([(infos[k], memoryview(outs[k].numpy())) for k in tensors])
    finally:
        reads.close()
    assert all(torch.equal(outs[k], tensors[k]) for k in tensors)
    assert pieces(10, 4) == [(0, 4), (4, 8), (8, 10)] and pieces(0) == []


def test_a_file_cut_short_is_raised_and_the_readers_stay_usable(tmp_path) -> None:
    path = tmp_path / "w.safetensors"
    safetensors.torch.save_file({"a": torch.ones(2**16), "b": torch.ones(2**16)}, str(path))
    infos = SafetensorsFile(path).tensors
    os.truncate(path, infos["b"].offset + 100)
    reads = SplitReads(4, piece_bytes=4096)
    try:
        out = torch.empty(2**16)
        with pytest.raises(CheckpointError, match="truncated"):
            reads.read([(infos["b"], memoryview(out.numpy()).cast("B"))])
        reads.read([(infos["a"], memoryview(out.numpy()).cast("B"))])  # the pool still reads
        assert torch.equal(out, torch.ones(2**16))
    finally:
        reads.close()
