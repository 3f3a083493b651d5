"""Big-model inference, nbaccel against Accelerate: interleaved runs in fresh processes.

Writes a fp32 checkpoint (a stack of identical blocks, 32 safetensors shards and an index;
1 GiB at the default 32 blocks) under /tmp in two layouts: ``aligned``, its tensor data at
64-byte file offsets, and ``offset8``, 8 bytes off, as ``safetensors.save_file`` often leaves
it (nbaccel maps the first and must copy the second; see ``checkpoint_files.can_map``). Then,
for several rounds, each library in turn (the first one alternating), each run a fresh process:

(a) full load: an empty model, ``load_checkpoint_in_model(model, index, {"": "cpu"})``;
(b) dispatch: ``load_checkpoint_and_dispatch(model, index, device_map="auto",
    max_memory={"cpu": <a quarter of the model>}, no_split_module_classes=["Block"], ...)``;
(r) the baseline: reading the model's bytes once (``preadv`` into one reused buffer).

with the page cache warm (each file read just before) and cold (each file dropped from the
page cache with ``posix_fadvise(DONTNEED)``, which needs no root; checked with ``mincore``).
Each run reports load time, first and second forward, peak RSS and its part above the
process's baseline. Figures print as medians with [min..max], and nbaccel/Accelerate as the
ratio of medians with the [min..max] of the per-round ratios. The outputs of all runs are
checked equal. Last, 4 workers launched with ``notebook_launcher`` each load the whole model
(a): their summed PSS (proportional set size: shared pages split between their users) against
one model's size.

Then the GPU cases of ``benchmarks/big_model_gpu.py`` (load onto one GPU, offloaded forwards from
CPU and disk, against Accelerate, raw torch and the bus-bound limit); without CUDA they print one
line saying they were skipped.

Run: ``.venv/bin/python benchmarks/big_model.py [--rounds 5] [--blocks 32] [--no-gpu]``
(needs ``pip install accelerate`` in the venv; nbaccel itself never imports it).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import mmap
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

WIDTH = 2048
SHARDS = 32
LIBS = ("nbaccel", "accelerate")
LAYOUTS = {"aligned": 0, "offset8": 8}  # where tensor data starts, mod 64


class Block(nn.Module):
    """Two square linears and a residual: 32 MiB of fp32 weights at width 2048."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.up = nn.Linear(width, width)
        self.down = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    def __init__(self, blocks: int, width: int = WIDTH) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.out = nn.Linear(width, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _save(tensors: dict[str, torch.Tensor], path: Path, data_start: int) -> None:
    """A safetensors file whose data starts ``data_start`` bytes past a multiple of 64 (the
    header is padded with spaces, as the format allows)."""
    header, offset = {}, 0
    for name, t in tensors.items():
        header[name] = {"dtype": "F32", "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.numel() * 4]}
        offset += t.numel() * 4
    raw = json.dumps(header).encode()
    raw += b" " * ((data_start - 8 - len(raw)) % 64)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for t in tensors.values():
            f.write(memoryview(t.contiguous().numpy()).cast("B"))
        f.flush()
        os.fsync(f.fileno())  # dirty pages could not be dropped for the cold runs


def write_checkpoints(root: Path, blocks: int) -> tuple[dict[str, Path], int]:
    """One folder per layout, the same tensors in each; returns the indexes and weight bytes."""
    gen = torch.Generator().manual_seed(0)
    names = [f"blocks.{i}.{layer}.{kind}" for i in range(blocks) for layer in ("up", "down")
             for kind in ("weight", "bias")] + ["out.weight", "out.bias"]
    shapes = {n: ((WIDTH, WIDTH) if n.endswith("weight") else (WIDTH,)) for n in names}
    shapes.update({"out.weight": (16, WIDTH), "out.bias": (16,)})
    per_shard = math.ceil(len(names) / SHARDS)
    folders = {layout: root / layout for layout in LAYOUTS}
    for folder in folders.values():
        folder.mkdir()
    weight_map, total = {}, 0
    for s in range(SHARDS):
        part = {n: torch.randn(shapes[n], generator=gen) * (0.3 / math.sqrt(WIDTH))
                for n in names[s * per_shard:(s + 1) * per_shard]}
        if not part:
            break
        file = f"model-{s + 1:05d}-of-{SHARDS:05d}.safetensors"
        for layout, folder in folders.items():
            _save(part, folder / file, LAYOUTS[layout])
        weight_map.update(dict.fromkeys(part, file))
        total += sum(t.numel() * 4 for t in part.values())
    index = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    for folder in folders.values():
        (folder / "model.safetensors.index.json").write_text(index)
    return {k: f / "model.safetensors.index.json" for k, f in folders.items()}, total


def _shards(index: Path) -> list[Path]:
    return sorted(index.parent.glob("*.safetensors"))


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def cached_fraction(files: list[Path]) -> float:
    """The fraction of the files' pages in the page cache (``mincore`` over a fresh map)."""
    cached = pages = 0
    for path in files:
        size = path.stat().st_size
        fd = os.open(path, os.O_RDONLY)
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        os.close(fd)
        n = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * n)()
        failed = _libc.mincore(ctypes.c_void_p(address), size, vec)
        _libc.munmap(ctypes.c_void_p(address), size)
        if failed:
            raise OSError(ctypes.get_errno(), "mincore failed")
        cached += sum(v & 1 for v in bytes(vec))
        pages += n
    return cached / max(pages, 1)


def set_cache(files: list[Path], state: str) -> float:
    """Make the files' pages warm (read once) or cold (dropped); returns the cached fraction."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            if state == "cold":
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            else:
                while os.read(fd, 2**24):
                    pass
        finally:
            os.close(fd)
    return cached_fraction(files)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _pss() -> tuple[int, int]:
    """This process's PSS, and the part of it that is file-backed, in bytes."""
    fields = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        key, value, *_ = line.split()
        fields[key.rstrip(":")] = int(value) * 1024
    return fields["Pss"], fields.get("Pss_File", 0)


def _folder_bytes(folder: Path) -> int:
    if not folder.exists():
        return 0
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _loaders(lib: str):  # noqa: ANN202 - the two libraries' functions of the same names
    if lib == "nbaccel":
        from nbaccel.big_modeling import (
            init_empty_weights,
            load_checkpoint_and_dispatch,
            load_checkpoint_in_model,
        )
    else:
        from accelerate import (
            init_empty_weights,
            load_checkpoint_and_dispatch,
            load_checkpoint_in_model,
        )
    return init_empty_weights, load_checkpoint_in_model, load_checkpoint_and_dispatch


def _sample() -> torch.Tensor:
    return torch.randn(1, 8, WIDTH, generator=torch.Generator().manual_seed(1))


def read_once(index: str) -> dict:
    """The baseline: every shard's bytes read once into one reused buffer."""
    files = _shards(Path(index))
    buffer = bytearray(max(p.stat().st_size for p in files))
    view = memoryview(buffer)
    start = time.perf_counter()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        done, size = 0, path.stat().st_size
        while done < size:
            done += os.preadv(fd, [view[done:size]], done)
        os.close(fd)
    return {"load_s": time.perf_counter() - start}


def worker(lib: str, scenario: str, index: str, blocks: int, out: str) -> dict:
    """One measurement, in its own process."""
    torch.set_num_threads(1)
    init_empty_weights, load_in_model, load_and_dispatch = _loaders(lib)
    x = _sample()
    baseline = _rss()
    offload = Path(out) / f"offload-{lib}-{scenario}"
    start = time.perf_counter()
    with init_empty_weights():
        model = Stack(blocks)
    if scenario == "full":
        load_in_model(model, index, device_map={"": "cpu"})
    else:
        model = load_and_dispatch(model, index, device_map="auto",
                                  max_memory={"cpu": f"{blocks * 8}MiB"},
                                  no_split_module_classes=["Block"], offload_folder=str(offload))
    load = time.perf_counter() - start
    times = []
    with torch.no_grad():
        for _ in range(2):
            start = time.perf_counter()
            y = model(x)
            times.append(time.perf_counter() - start)
    torch.save(y, Path(out) / f"out-{lib}-{scenario}-{os.getpid()}.pt")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"load_s": load, "forward1_s": times[0], "forward2_s": times[1],
            "total_s": load + times[0], "peak_rss": peak, "added_rss": peak - baseline,
            "written": _folder_bytes(offload)}


def measure(kind: str, lib: str, scenario: str, index: Path, blocks: int, out: Path) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, lib, scenario, str(index), str(blocks),
           str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parent.parent))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"{kind} {lib} {scenario} failed:\n{done.stderr[-3000:]}")
    shutil.rmtree(out / f"offload-{lib}-{scenario}", ignore_errors=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _pss_worker(lib: str, index: str, blocks: int) -> dict:
    import logging

    import torch.distributed as dist

    logging.disable(logging.WARNING)  # Accelerate warns once per shard that it has no metadata
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    init_empty_weights, load_in_model, _ = _loaders(lib)
    dist.barrier()
    before = _pss()
    with init_empty_weights():
        model = Stack(blocks)
    load_in_model(model, index, device_map={"": "cpu"})
    with torch.no_grad():
        model(_sample())
    dist.barrier()  # all four hold the model, every page touched, while each one measures
    after = _pss()
    dist.barrier()
    del model
    dist.destroy_process_group()
    return {"pss": after[0], "pss_file": after[1], "added": after[0] - before[0]}


def four_workers(lib: str, index: Path, blocks: int) -> dict:
    """4 workers launched by nbaccel's ``notebook_launcher`` (the loading is ``lib``'s)."""
    from nbaccel import notebook_launcher

    os.environ["OMP_NUM_THREADS"] = "1"
    results = notebook_launcher(_pss_worker, (lib, str(index), blocks), num_processes=4,
                                return_all=True, timeout=600)
    return {k: sum(r[k] for r in results.values()) for k in ("pss", "pss_file", "added")}


def _med(values: list[float]) -> str:
    return f"{statistics.median(values):.4g} [{min(values):.4g}..{max(values):.4g}]"


def _ratios(nb: list[dict], acc: list[dict], key: str) -> tuple[float, list[float]]:
    """The ratio of medians, and each round's own ratio (runs of one round are neighbours)."""
    a, b = [r[key] for r in nb], [r[key] for r in acc]
    return statistics.median(a) / statistics.median(b), [x / y for x, y in zip(a, b) if y]


METRICS = (("load_s", "load (s)", 1), ("forward1_s", "first forward (s)", 1),
           ("forward2_s", "second forward (s)", 1), ("total_s", "load + first fwd (s)", 1),
           ("peak_rss", "peak RSS (MiB)", 2**20), ("added_rss", "peak above base (MiB)", 2**20),
           ("written", "written to disk (MiB)", 2**20))


def report_case(title: str, nb: list[dict], acc: list[dict], read: list[dict] | None) -> dict:
    print(f"\n{title}   (median [min..max] of {len(nb)} runs each)")
    print(f"  {'':24}{'nbaccel':>26}{'Accelerate':>26}   ratio [per round]")
    ratios = {}
    for key, label, unit in METRICS:
        if key == "written" and not any(r[key] for r in nb + acc):
            continue
        ratio, rounds = _ratios(nb, acc, key) if any(r[key] for r in acc) else (math.nan, [])
        ratios[key] = ratio
        spread = f"[{min(rounds):.2f}..{max(rounds):.2f}]" if rounds else ""
        print(f"  {label:24}{_med([r[key] / unit for r in nb]):>26}"
              f"{_med([r[key] / unit for r in acc]):>26}   {ratio:.2f} {spread}")
    if read:
        ratio, rounds = _ratios(nb, read, "load_s")
        ratios["vs_read"] = ratio
        print(f"  read once (baseline) {_med([r['load_s'] for r in read])} s; nbaccel load / "
              f"read once {ratio:.2f} [{min(rounds):.2f}..{max(rounds):.2f}]")
    return ratios


def report(results: dict, caches: list[str], model_bytes: int, workers: dict) -> None:
    goals = []
    for cache in caches:
        print(f"\n=== page cache {cache} ===")
        for scenario in ("full", "dispatch"):
            for layout in LAYOUTS:
                nb = results.get((cache, scenario, layout, "nbaccel"))
                if not nb:
                    continue
                title = (f"(a) full CPU load, {layout}" if scenario == "full" else
                         f"(b) dispatch 'auto', cpu quarter + disk, {layout}")
                read = results.get((cache, "read", layout, "baseline"))
                r = report_case(title, nb, results[(cache, scenario, layout, "accelerate")],
                                read if scenario == "full" else None)
                if scenario == "full":
                    goals.append((cache, layout, r))
    print("\n=== 4 launched workers, each holding the whole model (a, aligned) ===")
    for lib, w in workers.items():
        print(f"  {lib:11} PSS of the 4 workers {w['pss'] / model_bytes:.2f} models "
              f"(file-backed {w['pss_file'] / model_bytes:.2f}); added by loading "
              f"{w['added'] / model_bytes:.2f} models ({w['added'] / 2**20:.0f} MiB; one model "
              f"is {model_bytes / 2**20:.0f} MiB)")
    print("\n=== goals (full CPU load; ratios of medians) ===")
    for cache, layout, r in goals:
        checks = [("load <= 0.5x Accelerate", r["load_s"], 0.5),
                  ("load <= 1.5x read once", r.get("vs_read", math.nan), 1.5),
                  ("peak RSS <= 1.0x", r["peak_rss"], 1.0),
                  ("first forward <= 1.0x", r["forward1_s"], 1.0),
                  ("second forward <= 1.0x", r["forward2_s"], 1.0)]
        print(f"  {cache:5} {layout:8} " + "; ".join(
            f"{label} {value:.2f} {'met' if value <= limit else 'NOT met'}"
            for label, value, limit in checks))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=32, help="blocks of 32 MiB (32: 1 GiB)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved runs per case")
    parser.add_argument("--no-cold", action="store_true", help="skip the cold-cache runs")
    parser.add_argument("--no-workers", action="store_true", help="skip the 4-worker PSS")
    parser.add_argument("--no-gpu", action="store_true", help="skip the GPU cases (big_model_gpu.py)")
    parser.add_argument("--gpu-rounds", type=int, default=3, help="interleaved runs per GPU case")
    parser.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, lib, scenario, index, blocks, out = args.worker
        result = read_once(index) if kind == "read" else \
            worker(lib, scenario, index, int(blocks), out)
        print(json.dumps(result))
        return
    print(f"load average at start (1, 5, 15 min): {os.getloadavg()}, {os.cpu_count()} CPUs")
    root = Path(tempfile.mkdtemp(prefix="nbaccel-bigmodel-", dir="/tmp"))
    try:
        start = time.perf_counter()
        indexes, model_bytes = write_checkpoints(root, args.blocks)
        print(f"checkpoint: {model_bytes / 2**30:.2f} GiB in {SHARDS} shards, layouts "
              f"{LAYOUTS} (data start mod 64), written in {time.perf_counter() - start:.1f}s")
        caches = ["warm"] + ([] if args.no_cold else ["cold"])
        results: dict[tuple, list[dict]] = {}
        found: dict[str, list[float]] = {c: [] for c in caches}
        for round_ in range(args.rounds):
            libs = LIBS if round_ % 2 == 0 else LIBS[::-1]
            for cache in caches:
                for scenario in ("full", "dispatch") if cache == "warm" else ("full",):
                    for layout, index in indexes.items():
                        runs = [("run", lib) for lib in libs]
                        if scenario == "full":
                            runs.append(("read", "baseline"))
                        for kind, lib in runs:
                            found[cache].append(set_cache(_shards(index), cache))
                            r = measure(kind, lib, scenario, index, args.blocks, root)
                            key = (cache, "read" if kind == "read" else scenario, layout, lib)
                            results.setdefault(key, []).append(r)
            print(f"round {round_ + 1}/{args.rounds} done, load average {os.getloadavg()}",
                  flush=True)
        outputs = [torch.load(p, weights_only=True) for p in root.glob("out-*.pt")]
        same = all(torch.equal(outputs[0], o) for o in outputs)
        print(f"outputs of all {len(outputs)} runs identical: {same}")
        for cache in caches:
            print(f"page-cache residency before {cache} runs (mincore): "
                  f"{_med([100 * f for f in found[cache]])} %")
        workers = {} if args.no_workers else {
            lib: four_workers(lib, indexes["aligned"], args.blocks) for lib in LIBS}
        report(results, caches, model_bytes, workers)
        print(f"\nload average at end (1, 5, 15 min): {os.getloadavg()}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if not args.no_gpu:
        from big_model_gpu import (
            run,  # next to this file: its own checkpoint, bf16, on one GPU
        )

        run(args.gpu_rounds)


if __name__ == "__main__":
    main()
