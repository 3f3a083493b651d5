"""Reading checkpoint tensors onto devices on reader threads (CPU here; scripts/check_gpu_loading.py
runs the same on a GPU): the read plan, exact bytes, errors, progress reports."""

from __future__ import annotations

import os

import pytest
import safetensors.torch
import torch

from nbaccel.big_modeling.checkpoint_files import SafetensorsFile, TensorInfo
from nbaccel.big_modeling.device_reads import plan_reads, read_to_devices
from nbaccel.errors import CheckpointError


def _info(path: str, offset: int, nbytes: int) -> TensorInfo:
    return TensorInfo(path, offset, nbytes, torch.uint8, (nbytes,))


def test_small_neighbours_share_a_read_and_big_tensors_span_several() -> None:
    infos = [_info("a", 0, 10), _info("a", 10, 3), _info("a", 13, 40), _info("a", 60, 5),
             _info("b", 0, 2), _info("a", 65, 0)]
    reads = plan_reads(infos, 16)
    assert [(r.path, r.offset, r.nbytes) for r in reads] == [
        ("a", 0, 16), ("a", 16, 16), ("a", 32, 16), ("a", 48, 5), ("a", 60, 5), ("b", 0, 2)]
    assert reads[0].pieces == [(0, 0, 0, 10), (1, 0, 10, 3), (2, 0, 13, 3)]
    covered = {}  # every byte of every tensor is read exactly once
    for r in reads:
        for k, start, at, n in r.pieces:
            assert r.offset + at == infos[k].offset + start and at + n <= r.nbytes <= 16
            covered[k] = covered.get(k, 0) + n
    assert covered == {0: 10, 1: 3, 2: 40, 3: 5, 4: 2}


@pytest.mark.parametrize("buffer_bytes,readers", [(7, 1), (64, 3), (1000, 4), (2**20, 2)])
def test_threaded_reads_are_exact_in_any_order_and_chunking(tmp_path, buffer_bytes, readers) -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": (torch.randn(n, generator=gen) * 50).to(dtype) for i, (n, dtype) in
               enumerate(zip([33, 1, 0, 250, 17, 4096] * 2, [torch.float32, torch.int8,
                             torch.float16, torch.bfloat16, torch.float64, torch.int64] * 2))}
    names = list(tensors)
    safetensors.torch.save_file({n: tensors[n] for n in names[:6]}, tmp_path / "a.safetensors")
    safetensors.torch.save_file({n: tensors[n] for n in names[6:]}, tmp_path / "b.safetensors")
    infos = {**SafetensorsFile(tmp_path / "a.safetensors").tensors,
             **SafetensorsFile(tmp_path / "b.safetensors").tensors}
    order = sorted(infos, reverse=True)
    issued: dict[int, int] = {}

    def report(k: int, n: int) -> None:
        issued[k] = issued.get(k, 0) + n

    out = read_to_devices([infos[n] for n in order], ["cpu"] * len(order), buffer_bytes,
                          readers=readers, on_piece=report)
    for k, (name, tensor) in enumerate(zip(order, out)):
        assert tensor.dtype == tensors[name].dtype and tensor.shape == tensors[name].shape
        assert torch.equal(tensor.view(torch.uint8), tensors[name].view(torch.uint8)), name
        assert issued.get(k, 0) == infos[name].nbytes


def test_a_file_cut_short_is_found_before_any_read_and_named(tmp_path) -> None:
    path = tmp_path / "w.safetensors"
    safetensors.torch.save_file({f"w{i}": torch.ones(4096) for i in range(8)}, path)
    infos = list(SafetensorsFile(path).tensors.values())
    os.truncate(path, infos[-1].offset + 10)
    with pytest.raises(CheckpointError) as caught:
        read_to_devices(infos, ["cpu"] * len(infos), buffer_bytes=4096, readers=4)
    assert caught.value.path == str(path) and "truncated" in str(caught.value)


def test_nothing_to_read_gives_empty_tensors() -> None:
    out = read_to_devices([_info("nowhere", 0, 0)], ["cpu"])
    assert out[0].shape == (0,)


def test_the_caller_is_called_back_in_its_own_thread_while_readers_run(tmp_path) -> None:
    import threading
    import time

    path = tmp_path / "w.safetensors"
    safetensors.torch.save_file({"w": torch.ones(64)}, path)
    info = SafetensorsFile(path).tensors["w"]
    seen = []
    read_to_devices([info], ["cpu"], on_piece=lambda k, n: time.sleep(0.5),
                    on_wait=lambda: seen.append(threading.current_thread()))
    assert seen and set(seen) == {threading.current_thread()}


_INTERRUPTED_LOAD = r"""
import json, os, sys, threading, time
import safetensors.torch, torch
from nbaccel.big_modeling.checkpoint_files import SafetensorsFile
from nbaccel.big_modeling.device_reads import read_to_devices

path = os.path.join(sys.argv[1], "big.safetensors")
safetensors.torch.save_file({f"w{i}": torch.full((2**20,), float(i)) for i in range(64)}, path)
infos = list(SafetensorsFile(path).tensors.values())
issued, lock = [0], threading.Lock()

def report(k, n):
    with lock:
        if issued[0] == 0:
            print("loading", flush=True)  # the readers run
        issued[0] += n

try:
    # page-sized buffers: 65536 reads of 256 MiB, seconds of loading on any machine
    read_to_devices(infos, ["cpu"] * len(infos), buffer_bytes=4096, readers=2, on_piece=report)
    result = {"finished": time.monotonic()}
except KeyboardInterrupt:
    result = {"caught": time.monotonic()}
result.update(issued=issued[0], total=sum(i.nbytes for i in infos),
              readers=[t.name for t in threading.enumerate() if t.name.startswith("nbaccel-gpu-read")])
print(json.dumps(result), flush=True)
"""


def test_ctrl_c_during_a_load_is_raised_within_half_a_second_and_stops_the_readers(tmp_path) -> None:
    import json
    import signal
    import subprocess
    import sys
    import time

    child = subprocess.Popen([sys.executable, "-c", _INTERRUPTED_LOAD, str(tmp_path)],
                             stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        assert child.stdout.readline().strip() == "loading"
        time.sleep(0.3)
        sent = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process on the machine
        child.send_signal(signal.SIGINT)
        result = json.loads(child.stdout.readline())
    finally:
        child.kill()
        child.wait()
    assert "caught" in result, f"the load finished before the interrupt: {result}"
    assert result["caught"] - sent < 0.5, f"Ctrl-C surfaced {result['caught'] - sent:.2f} s after it was sent"
    assert 0 < result["issued"] < result["total"]  # the readers stopped mid-load
    assert result["readers"] == []  # no reader thread outlives the interrupt
