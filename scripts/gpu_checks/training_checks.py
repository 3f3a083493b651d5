"""Checks of training on GPUs: counting them without CUDA, NCCL, data loading, precision, FSDP2.

Each launches :mod:`gpu_checks.workers` code on every GPU and compares what comes back; none
touches CUDA in this process.
"""

from __future__ import annotations

import tempfile

import torch

from gpu_checks import workers
from gpu_checks.runner import Check, expect, launch, registrar

__all__ = ["CHECKS"]

CHECKS: list[Check] = []
check = registrar(CHECKS)


@check("gpu-count")
def _count(gpus: int) -> str:
    from nbaccel.cuda_probe import cuda_fork_poisoned, nvml_gpus

    expect(gpus > 0 and not torch.cuda.is_initialized() and not cuda_fork_poisoned(),
           f"{gpus} GPUs; CUDA initialized={torch.cuda.is_initialized()}")
    info = nvml_gpus()
    names = sorted({f"{g.name} (sm{g.capability[0]}{g.capability[1]})" for g in info[1]}) if info else ["NVML n/a"]
    return f"{gpus} GPU(s) counted without touching CUDA: {', '.join(names)}; driver {info[0] if info else '?'}"


@check("helpers-keep-fork-safe")
def _helpers(gpus: int) -> str:
    import nbaccel
    from nbaccel.hardware import fork_unsafe_reason
    from nbaccel.training.random import capture_rng_state

    nbaccel.set_seed(0)
    accelerator = nbaccel.Accelerator()
    accelerator.free_memory()
    capture_rng_state()
    reason = fork_unsafe_reason()
    expect(reason is None and not torch.cuda.is_initialized(), f"fork unsafe after helpers: {reason}")
    return f"set_seed, Accelerator() (device {accelerator.device}), free_memory, capture_rng_state: fork still safe"


@check("nccl-all-reduce")
def _nccl(gpus: int) -> str:
    results = launch(workers.all_reduce, n=gpus)
    expected = gpus * (gpus + 1) / 2
    expect(all(v[2] == expected for v in results.values()), results)
    expect(len({v[1] for v in results.values()}) == gpus, f"devices {[v[1] for v in results.values()]}")
    return f"{gpus} rank(s), one device each, sum {expected:g} (launched with fork)"


@check("shuffled-loader")
def _loader(gpus: int) -> str:
    for own_generator in (False, True):
        results = launch(workers.shuffled, own_generator, n=gpus)
        orders = list(results.values())
        expect(all(o == orders[0] for o in orders), "ranks gathered different orders")
        expect(sorted(orders[0]) == list(range(64)) and orders[0] != list(range(64)),
               f"not a shuffle of 0..63: {orders[0][:8]}...")
    return "shuffle=True with and without a generator: every sample once, same order on every rank"


@check("accumulation-no-sync")
def _accumulation(gpus: int) -> str:
    synced, spread = launch(workers.accumulate, n=gpus)[0]
    expect(synced[:4] == [False, True, False, True], f"sync pattern {synced[:4]}")
    expect(spread < 1e-6, f"ranks' gradients differ by {spread:g} after the sync step")
    return f"{len(synced)} micro-steps, optimizer every 2nd, synced gradients equal across ranks"


@check("mixed-precision")
def _precision(gpus: int) -> str:
    gaps = launch(workers.precisions, n=gpus)[0]
    expect(all(gap < 5e-2 for gap in gaps.values()), gaps)
    return ("fp16 (GradScaler) and bf16 weights within 5e-2 of fp32: "
            + ", ".join(f"{k} {v:.1e}" for k, v in gaps.items()))


@check("fp16-clipping")
def _clipping(gpus: int) -> str:
    gap, refused = launch(workers.fp16_clipping, n=gpus)[0]
    expect(gap < 5e-2 and refused == "refused", f"gap {gap:g}, clipping on a non-sync step {refused}")
    return f"clip at sync steps matches fp32 ({gap:.1e}); clipping a non-sync micro-step refused"


@check("save-load-state")
def _save_load_state(gpus: int) -> str:
    with tempfile.TemporaryDirectory() as folder:
        gap, steps_on, moments_on = launch(workers.save_load, folder, n=gpus)[0]
    expect(gap < 1e-5, f"resumed weights differ by {gap:g}")
    expect(steps_on == "cpu" and moments_on.startswith("cuda"), f"Adam step on {steps_on}, moments on {moments_on}")
    return f"fp16 Adam resumed exactly; step counters on {steps_on}, moments on {moments_on}"


def _fsdp_check(gpus: int, offload: bool) -> str:
    from nbaccel import LaunchConfig

    config = LaunchConfig(distributed_type="FSDP", fsdp_config={"fsdp_offload_params": offload,
                                                               "fsdp_state_dict_type": "FULL_STATE_DICT"})
    backend, norm, keys = launch(workers.fsdp, n=gpus, config=config)[0]
    expect(norm == norm and keys == 4, f"norm {norm}, full state dict keys {keys}")
    if offload:
        expect(backend == "cuda:nccl,cpu:gloo", f"backend {backend!r}")
    return f"FSDP2 over {gpus} GPUs, backend {backend}, clip_grad_norm_ {norm:.3f}, full state dict gathered"


@check("fsdp2", min_gpus=2)
def _fsdp2(gpus: int) -> str:
    return _fsdp_check(gpus, offload=False)


@check("fsdp2-cpu-offload", min_gpus=2)
def _fsdp2_offload(gpus: int) -> str:
    return _fsdp_check(gpus, offload=True)


@check("fsdp2-shard-first")
def _fsdp2_shard_first(gpus: int) -> str:
    got = launch(workers.fsdp_shard_first, n=1)[0]
    expect(got["devices"] == ["cuda:0"] and got["dtypes"] == ["torch.float32"], got)
    expect(got["meta_left"] == 0 and got["round_trip"], got)
    expect(got["peak"] < 1.3, f"peak while sharding: {got['peak']:.2f}x the float32 model (placing first: 1.5x)")
    return (f"a bf16 model on CPU sharded onto cuda:0 and upcast per shard (peak {got['peak']:.2f}x its fp32 size), "
            "a meta-device model materialized there, a full state dict round-tripped through rank 0's broadcast")
