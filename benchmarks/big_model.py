"""Big-model inference, nbaccel against Accelerate, side by side from one run.

Writes a ~2 GiB fp32 checkpoint (a stack of identical blocks, 32 safetensors shards and an
index) under /tmp, then for each library, each in a fresh subprocess:

(a) full load: an empty model, ``load_checkpoint_in_model(model, index, {"": "cpu"})``;
(b) dispatch: ``load_checkpoint_and_dispatch(model, index, device_map="auto",
    max_memory={"cpu": "512MiB"}, no_split_module_classes=["Block"], offload_folder=...)``.

Each reports load time, first and second forward time, peak resident memory (and the part of
it above the process's baseline after imports), and bytes written to the offload folder; the
outputs of all runs are checked equal. Figures print as nbaccel / Accelerate ratios. The
checkpoint is deleted at the end.

Run: ``.venv/bin/python benchmarks/big_model.py [--repeats 2] [--blocks 64]``
(needs ``pip install accelerate`` in the venv; nbaccel itself never imports it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

WIDTH = 2048
SHARDS = 32


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


def write_checkpoint(folder: Path, blocks: int) -> tuple[Path, int]:
    """32 shards and an index; returns the index path and the bytes of weights."""
    import safetensors.torch

    gen = torch.Generator().manual_seed(0)
    names = [f"blocks.{i}.{layer}.{kind}" for i in range(blocks) for layer in ("up", "down")
             for kind in ("weight", "bias")] + ["out.weight", "out.bias"]
    shapes = {n: ((WIDTH, WIDTH) if n.endswith("weight") else (WIDTH,)) for n in names}
    shapes.update({"out.weight": (16, WIDTH), "out.bias": (16,)})
    per_shard = math.ceil(len(names) / SHARDS)
    weight_map, total = {}, 0
    for s in range(SHARDS):
        part = {n: torch.randn(shapes[n], generator=gen) * (0.3 / math.sqrt(WIDTH))
                for n in names[s * per_shard:(s + 1) * per_shard]}
        if not part:
            break
        file = f"model-{s + 1:05d}-of-{SHARDS:05d}.safetensors"
        safetensors.torch.save_file(part, str(folder / file))
        weight_map.update(dict.fromkeys(part, file))
        total += sum(t.numel() * 4 for t in part.values())
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return index, total


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _folder_bytes(folder: Path) -> int:
    if not folder.exists():
        return 0
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def worker(lib: str, scenario: str, index: str, blocks: int, out: str) -> None:
    """One measurement, in its own process; prints one JSON line."""
    torch.set_num_threads(1)
    if lib == "nbaccel":
        from nbaccel.big_modeling import init_empty_weights, load_checkpoint_and_dispatch, load_checkpoint_in_model
    else:
        from accelerate import init_empty_weights, load_checkpoint_and_dispatch, load_checkpoint_in_model
    x = torch.randn(1, 8, WIDTH, generator=torch.Generator().manual_seed(1))
    baseline = _rss()
    offload = Path(out) / f"offload-{lib}-{scenario}"
    start = time.perf_counter()
    with init_empty_weights():
        model = Stack(blocks)
    if scenario == "full":
        load_checkpoint_in_model(model, index, device_map={"": "cpu"})
    else:
        model = load_checkpoint_and_dispatch(model, index, device_map="auto",
                                             max_memory={"cpu": "512MiB"},
                                             no_split_module_classes=["Block"],
                                             offload_folder=str(offload))
    load = time.perf_counter() - start
    times = []
    with torch.no_grad():
        for _ in range(2):
            start = time.perf_counter()
            y = model(x)
            times.append(time.perf_counter() - start)
    torch.save(y, Path(out) / f"out-{lib}-{scenario}.pt")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    on_cpu = sum(1 for d in getattr(model, "hf_device_map", {"": "cpu"}).values() if d == "cpu")
    print(json.dumps({"load_s": load, "forward1_s": times[0], "forward2_s": times[1],
                      "peak_rss": peak, "baseline_rss": baseline,
                      "written": _folder_bytes(offload), "cpu_entries": on_cpu}))


def measure(lib: str, scenario: str, index: Path, blocks: int, out: Path) -> dict:
    cmd = [sys.executable, __file__, "--worker", lib, scenario, str(index), str(blocks),
           str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parent.parent))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"{lib} {scenario} failed:\n{done.stderr[-3000:]}")
    shutil.rmtree(out / f"offload-{lib}-{scenario}", ignore_errors=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _mib(n: float) -> str:
    return f"{n / 2**20:8.0f} MiB"


def report(results: dict, model_bytes: int, blocks: int) -> None:
    block = model_bytes / blocks
    for scenario, title in (("full", "(a) full load"),
                            ("dispatch", "(b) dispatch, device_map='auto', cpu 512MiB + disk")):
        nb, acc = results[("nbaccel", scenario)], results[("accelerate", scenario)]
        print(f"\n{title}")
        print(f"  {'':22}{'nbaccel':>14}{'Accelerate':>14}{'ratio':>9}")
        for key, label in (("load_s", "load"), ("forward1_s", "first forward"),
                           ("forward2_s", "second forward")):
            print(f"  {label:22}{nb[key]:13.2f}s{acc[key]:13.2f}s{nb[key] / acc[key]:9.2f}")
        for key, label in (("peak_rss", "peak RSS"), ("added", "peak above baseline"),
                           ("written", "written to disk")):
            ratio = nb[key] / acc[key] if acc[key] else float("nan")
            print(f"  {label:22}{_mib(nb[key]):>14}{_mib(acc[key]):>14}{ratio:9.2f}")
        if scenario == "full":
            print(f"  peak above baseline / model size: nbaccel {nb['added'] / model_bytes:.2f}, "
                  f"Accelerate {acc['added'] / model_bytes:.2f}")
        else:
            print(f"  peak above baseline, in 512 MiB + blocks ({block / 2**20:.0f} MiB each): "
                  f"nbaccel {(nb['added'] - 2**29) / block:+.1f} blocks, "
                  f"Accelerate {(acc['added'] - 2**29) / block:+.1f} blocks")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=64, help="blocks of 32 MiB (64: 2 GiB)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per case; the fastest "
                        "load is kept")
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        lib, scenario, index, blocks, out = args.worker
        return worker(lib, scenario, index, int(blocks), out)
    root = Path(tempfile.mkdtemp(prefix="nbaccel-bigmodel-", dir="/tmp"))
    try:
        ckpt = root / "ckpt"
        ckpt.mkdir()
        start = time.perf_counter()
        index, model_bytes = write_checkpoint(ckpt, args.blocks)
        print(f"checkpoint: {model_bytes / 2**30:.2f} GiB in {SHARDS} shards, "
              f"written in {time.perf_counter() - start:.1f}s ({root})")
        results = {}
        for _ in range(args.repeats):
            for scenario in ("full", "dispatch"):
                for lib in ("nbaccel", "accelerate"):
                    r = measure(lib, scenario, index, args.blocks, root)
                    r["added"] = r["peak_rss"] - r["baseline_rss"]
                    best = results.get((lib, scenario))
                    if best is None or r["load_s"] < best["load_s"]:
                        results[(lib, scenario)] = r
        outputs = {k: torch.load(root / f"out-{k[0]}-{k[1]}.pt", weights_only=True)
                   for k in results}
        first = next(iter(outputs.values()))
        same = all(torch.equal(first, o) for o in outputs.values())
        print(f"outputs of all four runs identical: {same}")
        report(results, model_bytes, args.blocks)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
