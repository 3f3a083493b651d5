"""Big-model inference on one GPU: nbaccel, Accelerate and raw torch against the bus-bound limit.

Writes a bf16 checkpoint of ``--gpu-layers`` ``Linear(W, W, bias=False)`` layers (4 GiB at the
default 32 x 8192) in 6 safetensors shards, then, each library in a fresh process, interleaved
over ``--gpu-rounds`` rounds, with the page cache warm:

(g1) load onto ``cuda:0``: ``load_checkpoint_and_dispatch(model, index, {"": 0})``; raw torch is
     ``safetensors.torch.load_file(shard, device="cuda:0")`` for every shard;
(g2) ``device_map="auto"`` with ``max_memory={0: "1GiB"}`` (the rest on the CPU): one forward of
     4 rows, best of 5 after a first; raw torch is the whole model resident on the GPU (compute
     only);
(g3) as (g2) with ``max_memory={0: "1GiB", "cpu": <a third of the model>}`` (the rest on disk);
(g4) a transformers ``LlamaForCausalLM`` of about 6 GiB bf16 with a quarter on the GPU and the rest
     offloaded to the CPU: prefill and greedy generation per library (``big_model_gpu_llama.py``),
     with the bus limit, ratios and whether both produce the same tokens.

The limit is the bytes that must cross the bus (the whole model for g1, the offloaded bytes of
each library's own map for g2/g3) over the pinned host-to-device bandwidth measured here (1 GiB,
best of 5). Figures print as medians with ratios; outputs of nbaccel and Accelerate are checked
identical. On a machine without CUDA it prints one line saying so and returns.

Run: ``python benchmarks/big_model_gpu.py [--cases linear,llama]`` or, after the CPU cases, ``benchmarks/big_model.py``.
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


def case_budget(case: str, layers: int, width: int) -> dict | None:
    """``max_memory`` of a case; sizes in bytes as ints, which both libraries accept (neither
    parses a ``"123B"`` string).

    Example:
        >>> case_budget("auto_disk", 3, 64)
        {0: '1GiB', 'cpu': 8192}
    """
    third = layers * width * width * 2 // 3  # bf16: a third of the model on the CPU
    return {"load": None, "auto_cpu": {0: "1GiB", "cpu": "200GiB"},
            "auto_disk": {0: "1GiB", "cpu": third}}[case]


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
        budget = case_budget(case, layers, width)
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


def run_llama(root: Path, bus: float, rounds: int, layers: int) -> None:
    """The transformers Llama case (``big_model_gpu_llama``): per library, interleaved, fresh
    processes; medians with their spread, ratios, the bus limit, and whether tokens agree."""
    import big_model_gpu_llama as llama

    (root / "llama").mkdir()
    folder, total = llama.write_llama(root / "llama", llama.llama_config(layers))
    results: dict[str, list[dict]] = {"nbaccel": [], "accelerate": []}
    for round_ in range(rounds):
        for lib in (("nbaccel", "accelerate") if round_ % 2 == 0 else ("accelerate", "nbaccel")):
            results[lib].append(_measure_args(["--llama-worker", lib, str(folder), str(root)]))
        print(f"Llama round {round_ + 1}/{rounds} done", flush=True)
    tokens = {json.dumps(json.loads(p.read_text())) for p in root.glob("llama-tokens-*.json")}
    print(f"\n=== transformers Llama, {total / 2**30:.2f} GiB bf16, a quarter on GPU 0; "
          f"bus {bus / 1e9:.1f} GB/s ===\n  same tokens from every run of both libraries: {len(tokens) == 1}")
    print(llama_lines(results, bus))
    print(f"  nbaccel's offload_report: {results['nbaccel'][-1]['report']}")
    nb = _med([r["prefill_s"] for r in results["nbaccel"]])
    acc = _med([r["prefill_s"] for r in results["accelerate"]])
    limit = _med([r["offloaded"] for r in results["nbaccel"]]) / bus
    rates = {lib: _med([r["tokens"] / r["generate_s"] for r in results[lib]]) for lib in results}
    print("=== goals (issue 34) ===")
    for label, ok in ((f"prefill <= 1.5x the bus limit: {nb / limit:.2f}", nb <= 1.5 * limit),
                      (f"prefill <= 0.25x Accelerate's: {nb / acc:.2f}", nb <= 0.25 * acc),
                      (f"generation >= 4x Accelerate's tokens/s: {rates['nbaccel'] / rates['accelerate']:.2f}",
                       rates["nbaccel"] >= 4 * rates["accelerate"]),
                      ("tokens identical", len(tokens) == 1)):
        print(f"  {label} {'met' if ok else 'NOT met'}")


def llama_lines(results: dict[str, list[dict]], bus: float) -> str:
    """The Llama figures: prefill and generation per library (median [min-max]), ratios, limits.

    Example:
        >>> r = {"prefill_s": 1.0, "generate_s": 4.0, "tokens": 16, "offloaded": 10**9, "load_s": 2.0}
        >>> print(llama_lines({"nbaccel": [r], "accelerate": [dict(r, prefill_s=4.0, generate_s=32.0)]}, 2e9))
          prefill (s): nbaccel 1.000 [1.000-1.000]; accelerate 4.000 [4.000-4.000]; nbaccel/accelerate 0.25; bus limit 0.500 (nbaccel/limit 2.00)
          generation (tokens/s): nbaccel 4.00 [4.00-4.00]; accelerate 0.50 [0.50-0.50]; nbaccel/accelerate 8.00; bus limit 2.00
          load (s): nbaccel 2.00; accelerate 2.00; offloaded: nbaccel 0.93 GiB, accelerate 0.93 GiB
    """  # noqa: E501 - the example's expected output: the lines as printed
    def spread(lib: str, value) -> tuple[float, float, float]:  # noqa: ANN001 - a function of a run
        got = [value(r) for r in results[lib]]
        return _med(got), min(got), max(got)

    def rate(r: dict) -> float:
        return r["tokens"] / r["generate_s"]

    nb, acc = spread("nbaccel", lambda r: r["prefill_s"]), spread("accelerate", lambda r: r["prefill_s"])
    limit = _med([r["offloaded"] for r in results["nbaccel"]]) / bus
    nb_rate, acc_rate = spread("nbaccel", rate), spread("accelerate", rate)
    gib = {lib: _med([r["offloaded"] for r in results[lib]]) / 2**30 for lib in results}
    return "\n".join([
        f"  prefill (s): nbaccel {nb[0]:.3f} [{nb[1]:.3f}-{nb[2]:.3f}]; accelerate {acc[0]:.3f} "
        f"[{acc[1]:.3f}-{acc[2]:.3f}]; nbaccel/accelerate {nb[0] / acc[0]:.2f}; bus limit {limit:.3f} "
        f"(nbaccel/limit {nb[0] / limit:.2f})",
        f"  generation (tokens/s): nbaccel {nb_rate[0]:.2f} [{nb_rate[1]:.2f}-{nb_rate[2]:.2f}]; "
        f"accelerate {acc_rate[0]:.2f} [{acc_rate[1]:.2f}-{acc_rate[2]:.2f}]; nbaccel/accelerate "
        f"{nb_rate[0] / acc_rate[0]:.2f}; bus limit {1 / limit:.2f}",
        f"  load (s): nbaccel {spread('nbaccel', lambda r: r['load_s'])[0]:.2f}; accelerate "
        f"{spread('accelerate', lambda r: r['load_s'])[0]:.2f}; offloaded: nbaccel {gib['nbaccel']:.2f} GiB, "
        f"accelerate {gib['accelerate']:.2f} GiB"])


def _measure_args(args: list[str]) -> dict:
    cmd = [sys.executable, __file__, *args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent.parent),
                                                        str(Path(__file__).parent)]))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"{args[:2]} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(rounds: int = 3, layers: int = 32, width: int = 8192, cases: tuple[str, ...] = ("linear", "llama"),
        llama_layers: int = 14) -> None:
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
        if "llama" in cases:
            run_llama(root, bus, rounds, llama_layers)
        if "linear" not in cases:
            return
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu-rounds", type=int, default=3)
    parser.add_argument("--gpu-layers", type=int, default=32)
    parser.add_argument("--gpu-width", type=int, default=8192)
    parser.add_argument("--cases", default="linear,llama", help="comma-separated: linear, llama")
    parser.add_argument("--llama-layers", type=int, default=14, help="14: about 6 GiB in bf16")
    parser.add_argument("--gpu-worker", nargs=6, help=argparse.SUPPRESS)
    parser.add_argument("--llama-worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.llama_worker:
        import big_model_gpu_llama

        print(json.dumps(big_model_gpu_llama.worker(*args.llama_worker)))
        return
    if args.gpu_worker:
        lib, case, index, layers, width, out = args.gpu_worker
        print(json.dumps(_bus() if lib == "bus" else
                         worker(lib, case, index, int(layers), int(width), out)))
        return
    run(args.gpu_rounds, args.gpu_layers, args.gpu_width, tuple(args.cases.split(",")), args.llama_layers)


if __name__ == "__main__":
    main()
