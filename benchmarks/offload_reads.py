"""Disk offload read throughput from the page cache: the streaming engine's staging reads against preadv.

Writes a checkpoint of ``--blocks`` blocks of four 16 MiB fp32 weights (64 MiB a block, 512 MiB
at the default 8) in two safetensors shards under /tmp, loads it with every block on ``"disk"``
(the offload index points into the checkpoint's own files), and streams the blocks through the
engine of :mod:`nbaccel.big_modeling.streamed_offload` on the CPU (synchronous copies, 3 slots):
each round acquires and releases every group in order, as a forward does, with no compute. The
files are read once first, so every read comes from the page cache. Figures, medians of
``--rounds`` rounds:

- engine: offloaded bytes per round / round time (each round reads every byte once, and copies
  it once more from staging into a slot, as on a GPU the copy engine would);
- group reads, whole / split: the staging reads alone, two groups in flight on four reader
  threads, each group read whole by one thread (``read_into``, the engine before this
  benchmark was added) or split in pieces over all four (``SplitReads``, the engine now);
- preadv x1 / x4: the same files read by one thread, and by four threads in 4 MiB pieces,
  into one reused buffer per thread: what the page cache gives.

Run the engine line of an older checkout with ``PYTHONPATH=<its root>`` to compare.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/offload_reads.py [--blocks 8] [--rounds 5]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import safetensors.torch
import torch
from torch import nn

from nbaccel.big_modeling import init_empty_weights, load_checkpoint_and_dispatch
from nbaccel.big_modeling.hooks import AlignDevicesHook
from nbaccel.big_modeling.checkpoint_files import SafetensorsFile, read_into
from nbaccel.big_modeling.streamed_offload import stream_offloaded

try:
    from nbaccel.big_modeling.staging_reads import SplitReads
except ImportError:  # an older checkout: only its engine line is measured
    SplitReads = None

WIDTH = 2048  # a 2048 x 2048 fp32 weight is 16 MiB
PIECE = 4 * 2**20


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(WIDTH, WIDTH, bias=False), nn.Linear(WIDTH, WIDTH, bias=False)
        self.c, self.d = nn.Linear(WIDTH, WIDTH, bias=False), nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(self.c(self.b(self.a(x))))


def _model(blocks: int) -> nn.Module:
    return nn.Sequential(*[Block() for _ in range(blocks)])


def write(root: Path, blocks: int) -> list[Path]:
    with torch.device("meta"):
        names = list(_model(blocks).state_dict())
    half = len(names) // 2
    files, weight_map = [], {}
    for k, chunk in enumerate([names[:half], names[half:]]):
        path = root / f"model-{k}.safetensors"
        safetensors.torch.save_file({n: torch.full((WIDTH, WIDTH), float(i)) for i, n in
                                     enumerate(chunk)}, str(path))
        files.append(path)
        weight_map.update({n: path.name for n in chunk})
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return files


def preadv(files: list[Path], threads: int) -> float:
    """Seconds to read every file once, on ``threads`` threads in PIECE-byte reads."""
    jobs = [(f, at) for f in files for at in range(0, f.stat().st_size, PIECE)]

    def run(share: list[tuple[Path, int]]) -> None:
        buffer = bytearray(PIECE)
        fds = {f: os.open(f, os.O_RDONLY) for f in files}
        for f, at in share:
            os.preadv(fds[f], [buffer], at)
        for fd in fds.values():
            os.close(fd)

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(run, [jobs[k::threads] for k in range(threads)]))
    return time.perf_counter() - start


def group_reads(files: list[Path], split: bool, in_flight: int = 2, readers: int = 4) -> float:
    """Seconds to read every tensor into staging buffers, ``in_flight`` groups at a time."""
    infos = [i for f in files for i in SafetensorsFile(f).tensors.values()]
    staging = [torch.empty(max(i.nbytes for i in infos), dtype=torch.uint8) for _ in range(in_flight + 1)]
    pool, pieces = ThreadPoolExecutor(readers), SplitReads(readers) if split else None
    pending = []
    start = time.perf_counter()
    for k, info in enumerate(infos):
        view = memoryview(staging[k % len(staging)][:info.nbytes].numpy())
        job = (lambda i=info, v=view: pieces.read([(i, v)])) if split else \
            (lambda i=info, v=view: read_into(i, v))
        pending.append(pool.submit(job))
        if len(pending) == in_flight:
            pending.pop(0).result()
    for future in pending:
        future.result()
    elapsed = time.perf_counter() - start
    pool.shutdown()
    if pieces is not None:
        pieces.close()
    return elapsed


def engine_rounds(files: list[Path], blocks: int, rounds: int) -> tuple[list[float], int]:
    with init_empty_weights():
        model = _model(blocks)
    index = files[0].parent / "model.safetensors.index.json"
    model = load_checkpoint_and_dispatch(model, str(index), {"": "disk"})
    hooks = [(m._hf_hook, m._hf_hook._names(m)) for m in model.modules()
             if isinstance(getattr(m, "_hf_hook", None), AlignDevicesHook) and m._hf_hook.offload
             and m._hf_hook._names(m)]
    assert stream_offloaded(hooks, torch.device("cpu"), slots=3) == [], "every hook streams"
    offload = hooks[0][0].streamed.offload
    nbytes = sum(m.nbytes for g in offload.engine.groups for m in g)
    times = []
    with torch.no_grad():
        for _ in range(rounds + 1):  # the first round fills the ring: not counted
            start = time.perf_counter()
            for group in range(len(offload.engine.groups)):
                offload.acquire(group)
                offload.release(group)
            times.append(time.perf_counter() - start)
    return times[1:], nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8, help="blocks of 64 MiB")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="nbaccel-offload-reads-") as tmp:
        files = write(Path(tmp), args.blocks)
        preadv(files, 1)  # into the page cache
        times, nbytes = engine_rounds(files, args.blocks, args.rounds)
        whole = [group_reads(files, False) for _ in range(args.rounds)]
        split = [group_reads(files, True) for _ in range(args.rounds)] if SplitReads else []
        one = [preadv(files, 1) for _ in range(args.rounds)]
        four = [preadv(files, 4) for _ in range(args.rounds)]
        total = sum(f.stat().st_size for f in files)
    gb = 1e9
    print(f"offloaded: {nbytes / 2**20:.0f} MiB in {args.blocks} blocks; {os.cpu_count()} CPUs; "
          f"torch threads {torch.get_num_threads()}")
    print(f"engine (3 slots, CPU):  {nbytes / statistics.median(times) / gb:6.2f} GB/s  "
          f"[{nbytes / max(times) / gb:.2f}..{nbytes / min(times) / gb:.2f}]")
    print(f"group reads, whole:    {total / statistics.median(whole) / gb:6.2f} GB/s")
    if split:
        print(f"group reads, split:    {total / statistics.median(split) / gb:6.2f} GB/s")
    print(f"preadv x1:             {total / statistics.median(one) / gb:6.2f} GB/s")
    print(f"preadv x4 (4 MiB):     {total / statistics.median(four) / gb:6.2f} GB/s")


if __name__ == "__main__":
    main()
