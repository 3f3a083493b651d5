"""Big-model inference on one GPU: nbaccel, Accelerate and raw torch against the bus-bound limit.

Writes a bf16 checkpoint of ``--gpu-layers`` ``Linear(W, W, bias=False)`` layers (4 GiB at the
default 32 x 8192) in 6 safetensors shards, then, each library in a fresh process, interleaved
over ``--gpu-rounds`` rounds, with the page cache warm:

(g1) load onto ``cuda:0``: ``load_checkpoint_and_dispatch(model, index, {"": 0})``; raw torch is
     ``safetensors.torch.load_file(shard, device="cuda:0")`` for every shard;
(g2) ``device_map="auto"`` with ``max_memory={0: "1GiB"}`` (the rest on the CPU): one forward of
     4 rows, best of 5 after a first; raw torch is the whole model resident on the GPU (compute
     only);
(g3) as (g2) with ``max_memory={0: "1GiB", "cpu": <a third of the model>}`` (the rest on disk).

The limit is the bytes that must cross the bus (the whole model for g1, the offloaded bytes of
each library's own map for g2/g3) over the pinned host-to-device bandwidth measured here (1 GiB,
best of 5). Figures print as medians with ratios; outputs of nbaccel and Accelerate are checked
identical. On a machine without CUDA it prints one line saying so and returns.

Run: ``python benchmarks/big_model_gpu.py`` or, after the CPU cases, ``benchmarks/big_model.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

SHARDS = 6
CASES = ("load", "auto_cpu", "auto_disk")
LIBS = ("nbaccel", "accelerate", "torch")


def _model(layers: int, width: int) -> nn.Module:
    return nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))


def write_checkpoint(root: Path, layers: int, width: int) -> tuple[Path, int]:
    import safetensors.torch

    gen = torch.Generator().manual_seed(0)
    names = [f"{i}.weight" for i in range(layers)]
    weight_map, total = {}, 0
    per = -(-layers // SHARDS)
    for s in range(SHARDS):
        part = {n: (torch.randn(width, width, generator=gen) / width ** 0.5).to(torch.bfloat16)
                for n in names[s * per:(s + 1) * per]}
        if not part:
            break
        file = f"model-{s + 1:05d}-of-{SHARDS:05d}.safetensors"
        safetensors.torch.save_file(part, str(root / file))
        weight_map.update(dict.fromkeys(part, file))
        total += sum(t.nbytes for t in part.values())
    index = root / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return index, total


def _warm(index: Path) -> None:
    for path in index.parent.glob("*.safetensors"):
        with open(path, "rb") as f:
            while f.read(2**24):
                pass


def _bus() -> dict:
    """Pinned host-to-device bandwidth, bytes per second (best of 5 copies of 1 GiB)."""
    host = torch.empty(2**30, dtype=torch.uint8, pin_memory=True)
    device = torch.empty_like(host, device="cuda:0")
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return {"bytes_per_s": host.nbytes / best}


def _loaders(lib: str):  # noqa: ANN202 - the two libraries' functions of the same names
    if lib == "nbaccel":
        from nbaccel.big_modeling import (
            init_empty_weights,
            load_checkpoint_and_dispatch,
        )
    else:
        from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    return init_empty_weights, load_checkpoint_and_dispatch


def _offloaded_bytes(model: nn.Module) -> int:
    placed = getattr(model, "hf_device_map", {})
    return sum(p.numel() * 2 for n, p in model.named_parameters()
               if placed.get(n.split(".")[0], 0) in ("cpu", "disk"))


def worker(lib: str, case: str, index: str, layers: int, width: int, out: str) -> dict:
    """One measurement, in its own process."""
    import safetensors.torch

    if lib != "torch":
        init_empty_weights, load_and_dispatch = _loaders(lib)  # imports are not timed
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(1)).to("cuda:0", torch.bfloat16)
    torch.cuda.synchronize()  # CUDA is initialized before the clock starts, for every library
    start = time.perf_counter()
    if lib == "torch":
        state = {}
        for path in sorted(Path(index).parent.glob("*.safetensors")):
            state.update(safetensors.torch.load_file(str(path), device="cuda:0"))
        torch.cuda.synchronize()
        load = time.perf_counter() - start
        with torch.device("meta"):
            model = _model(layers, width).to(torch.bfloat16)
        model.load_state_dict(state, assign=True)  # the GPU tensors themselves, no copy
    else:
        with init_empty_weights():
            model = _model(layers, width).to(torch.bfloat16)
        budget = {"load": None, "auto_cpu": {0: "1GiB", "cpu": "200GiB"},
                  "auto_disk": {0: "1GiB", "cpu": f"{layers * width * width * 2 // 3}B"}}[case]
        kwargs = {} if case == "load" else {"max_memory": budget,
                                            "offload_folder": str(Path(out) / f"off-{lib}-{os.getpid()}")}
        model = load_and_dispatch(model, index, {"": 0} if case == "load" else "auto", **kwargs)
        torch.cuda.synchronize()
        load = time.perf_counter() - start
    times = []
    with torch.no_grad():
        for _ in range(6):
            torch.cuda.synchronize()
            start = time.perf_counter()
            y = model(x)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    torch.save(y.cpu(), Path(out) / f"out-{case}-{lib}-{os.getpid()}.pt")
    return {"load_s": load, "forward_s": min(times[1:]), "first_forward_s": times[0],
            "offloaded": _offloaded_bytes(model) if lib != "torch" else 0}


def _measure(args: list[str], out: Path) -> dict:
    cmd = [sys.executable, __file__, "--gpu-worker", *args, str(out)]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent.parent))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if done.returncode:
        raise RuntimeError(f"{args[:2]} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _med(values: list[float]) -> float:
    return statistics.median(values)


def report(results: dict, bus: float, total: int) -> None:
    print(f"\n=== one GPU; pinned host-to-device {bus / 1e9:.1f} GB/s; model {total / 2**30:.2f} GiB ===")
    for case, key, what in (("load", "load_s", "(g1) load onto cuda:0 (s)"),
                            ("auto_cpu", "forward_s", "(g2) auto, most on CPU: forward (s)"),
                            ("auto_disk", "forward_s", "(g3) auto, some on disk: forward (s)")):
        runs = {lib: results.get((case, lib), []) for lib in LIBS}
        nb = _med([r[key] for r in runs["nbaccel"]])
        crossing = total if case == "load" else _med([r["offloaded"] for r in runs["nbaccel"]])
        limit = crossing / bus
        cells = [f"{lib} {_med([r[key] for r in runs[lib]]):.4f}" for lib in LIBS if runs[lib]]
        ratios = [f"nbaccel/{lib} {nb / _med([r[key] for r in runs[lib]]):.2f}"
                  for lib in ("accelerate", "torch") if runs[lib]]
        print(f"  {what}: {'; '.join(cells)}; limit {limit:.4f} ({crossing / 2**30:.2f} GiB over "
              f"the bus)\n      ratios: {'; '.join(ratios)}; nbaccel/limit {nb / limit:.2f}")
        if case != "load":
            loads = [f"{lib} {_med([r['load_s'] for r in runs[lib]]):.3f}" for lib in LIBS[:2]
                     if runs[lib]]
            print(f"      load (s, pinning included): {'; '.join(loads)}")
            acc = [r["offloaded"] for r in runs["accelerate"]]
            if acc:
                print(f"      offloaded: nbaccel {crossing / 2**30:.2f} GiB, Accelerate "
                      f"{_med(acc) / 2**30:.2f} GiB (nbaccel keeps room for 3 slots on the GPU)")


def goals(results: dict, bus: float, total: int) -> None:
    """Issue 25's goals, met or not, from the medians."""
    def med(case: str, lib: str, key: str) -> float:
        return _med([r[key] for r in results[(case, lib)]])

    checks = [("load onto one GPU <= 0.35x load_file(device='cuda')",
               med("load", "nbaccel", "load_s") / med("load", "torch", "load_s"), 0.35)]
    for case in ("auto_cpu", "auto_disk"):
        nb = med(case, "nbaccel", "forward_s")
        checks += [(f"{case} forward <= 0.25x Accelerate", nb / med(case, "accelerate", "forward_s"), 0.25),
                   (f"{case} forward <= 1.5x the bus-bound limit",
                    nb / (med(case, "nbaccel", "offloaded") / bus), 1.5)]
    print("\n=== goals (issue 25) ===")
    for label, value, limit in checks:
        print(f"  {label}: {value:.2f} {'met' if value <= limit else 'NOT met'}")


def run(rounds: int = 3, layers: int = 32, width: int = 8192) -> None:
    """All GPU cases, or one line saying why not.

    Example:
        >>> run(1, 2, 64)  # doctest: +SKIP
    """
    if not torch.cuda.is_available():
        print("GPU cases skipped: no CUDA device on this machine (they need one GPU).")
        return
    root = Path(tempfile.mkdtemp(prefix="nbaccel-bigmodel-gpu-", dir="/tmp"))
    try:
        index, total = write_checkpoint(root, layers, width)
        bus = _measure(["bus", "-", str(index), str(layers), str(width)], root)["bytes_per_s"]
        results: dict[tuple[str, str], list[dict]] = {}
        for round_ in range(rounds):
            for case in CASES:
                libs = LIBS if round_ % 2 == 0 else LIBS[::-1]
                for lib in libs:
                    if lib == "torch" and case == "auto_disk":
                        continue  # raw torch has no offload; its forward is g2's
                    _warm(index)
                    r = _measure([lib, case, str(index), str(layers), str(width)], root)
                    results.setdefault((case, lib), []).append(r)
            print(f"GPU round {round_ + 1}/{rounds} done", flush=True)
        for case in ("auto_cpu", "auto_disk"):
            outs = [torch.load(p, weights_only=True) for lib in ("nbaccel", "accelerate")
                    for p in root.glob(f"out-{case}-{lib}-*.pt")]
            print(f"outputs of {case}, nbaccel and Accelerate, identical: "
                  f"{all(torch.equal(outs[0], o) for o in outs)}")
        report(results, bus, total)
        goals(results, bus, total)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu-rounds", type=int, default=3)
    parser.add_argument("--gpu-layers", type=int, default=32)
    parser.add_argument("--gpu-width", type=int, default=8192)
    parser.add_argument("--gpu-worker", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.gpu_worker:
        lib, case, index, layers, width, out = args.gpu_worker
        print(json.dumps(_bus() if lib == "bus" else
                         worker(lib, case, index, int(layers), int(width), out)))
        return
    run(args.gpu_rounds, args.gpu_layers, args.gpu_width)


if __name__ == "__main__":
    main()
