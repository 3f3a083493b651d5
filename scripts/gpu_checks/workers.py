"""What the GPU checks launch: small training runs and probes, one function per worker job.

Each function runs inside a launched worker (rank 0's return value, or every rank's, comes
back to the check); none touches CUDA in the process that launches it. They also run on CPU
processes over gloo, which is how the CPU test suite checks them (``tests/test_check_gpu_script.py``).
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import torch
from torch import nn

__all__ = ["accumulate", "all_reduce", "cuda_module", "fp8_train", "fp16_clipping", "fsdp", "fsdp_shard_first",
           "hold_memory_then", "precisions", "save_load", "shuffled", "uuid"]


def all_reduce() -> tuple[int, str, float]:
    import torch.distributed as dist

    from nbaccel import ProcessState

    state = ProcessState()
    if not dist.is_initialized():  # one GPU: a one-rank NCCL group, so NCCL itself is exercised
        dist.init_process_group("nccl", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1,
                                device_id=state.device)
    value = torch.ones(1, device=state.device) * (state.process_index + 1)
    dist.all_reduce(value)
    return state.process_index, str(state.device), value.item()


def shuffled(seed_generator: bool) -> list[int]:
    from torch.utils.data import DataLoader

    from nbaccel import Accelerator

    accelerator = Accelerator()
    generator = torch.Generator().manual_seed(5) if seed_generator else None
    loader = accelerator.prepare(DataLoader(torch.arange(64), batch_size=4, shuffle=True, generator=generator))
    seen = [accelerator.gather(batch).cpu().tolist() for batch in loader]
    return [i for part in seen for i in part]


def _model_data(width: int = 16) -> tuple[nn.Module, Any]:
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, 32), nn.ReLU(), nn.Linear(32, 1))
    data = TensorDataset(torch.randn(128, width), torch.randn(128, 1))
    return model, DataLoader(data, batch_size=8)


def accumulate() -> tuple[list[bool], float]:
    from nbaccel import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, loader = _model_data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    synced, spread = [], 0.0
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            grad = next(model.parameters()).grad.detach().flatten()
            both = accelerator.gather(grad[None])
            if accelerator.sync_gradients:  # after the all-reduce every rank holds the same gradient
                spread = max(spread, float((both - both[0]).abs().max()))
            synced.append(accelerator.sync_gradients)
            optimizer.step()
            optimizer.zero_grad()
    return synced, spread


def _train(mixed_precision: str, clip_every: bool = False, steps: int | None = None) -> torch.Tensor:
    from nbaccel import Accelerator, GradScalerKwargs

    accelerator = Accelerator(mixed_precision=mixed_precision, gradient_accumulation_steps=2,
                              kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)])
    model, loader = _model_data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for step, (x, y) in enumerate(loader):
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            if clip_every or accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
        if steps is not None and step + 1 >= steps:
            break
    return torch.cat([p.detach().float().flatten().cpu() for p in model.parameters()])


def precisions() -> dict[str, float]:
    reference = _train("no")
    return {mp: float((_train(mp) - reference).abs().max()) for mp in ("fp16", "bf16")}


def fp16_clipping() -> tuple[float, str]:
    from nbaccel.errors import EnvironmentStateError

    gap = float((_train("fp16") - _train("no")).abs().max())
    try:
        _train("fp16", clip_every=True)
        refused = "not refused"
    except EnvironmentStateError:
        refused = "refused"
    return gap, refused


def save_load(folder: str) -> tuple[float, str, str]:
    from nbaccel import Accelerator

    def build() -> tuple[Any, Any, Any]:
        accelerator = Accelerator(mixed_precision="fp16")
        model, _ = _model_data()
        return (accelerator, *accelerator.prepare(model, torch.optim.Adam(model.parameters(), lr=0.01)))

    def steps(acc: Any, model: Any, optimizer: Any, first: int) -> torch.Tensor:
        for step in range(first, first + 3):  # the same batches before and after the resume
            generator = torch.Generator().manual_seed(step)
            x, y = torch.randn(8, 16, generator=generator), torch.randn(8, 1, generator=generator)
            acc.backward(nn.functional.mse_loss(model(x.to(acc.device)), y.to(acc.device)))
            optimizer.step()
            optimizer.zero_grad()
        return torch.cat([p.detach().flatten().cpu() for p in model.parameters()])

    acc, model, optimizer = build()
    steps(acc, model, optimizer, 0)
    acc.save_state(folder)
    expected = steps(acc, model, optimizer, 3)
    acc2, model2, optimizer2 = build()
    acc2.load_state(folder)
    step_devices = {str(s["step"].device) for s in optimizer2.state.values()}
    moment_devices = {str(s["exp_avg"].device) for s in optimizer2.state.values()}
    got = steps(acc2, model2, optimizer2, 3)
    return float((got - expected).abs().max()), ",".join(sorted(step_devices)), ",".join(sorted(moment_devices))


def fsdp() -> tuple[str, float, int]:
    from nbaccel import Accelerator

    accelerator = Accelerator()
    model, loader = _model_data(64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    norm = torch.zeros(())
    for x, y in loader:
        accelerator.backward(nn.functional.mse_loss(model(x.to(accelerator.device)), y.to(accelerator.device)))
        norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    full = accelerator.get_state_dict(model)
    return accelerator.state.backend, float(norm), len(full)


def fsdp_shard_first() -> dict[str, Any]:
    """``shard_model`` on a one-rank group: a bf16 model on CPU, and a model on the meta device.

    Returns where the shards ended up, their dtypes, the peak accelerator memory while sharding the
    bf16 model as a multiple of its float32 size (placing then upcasting the whole model first
    peaked at 1.5), and whether a full state dict round-trips through the rank-0 broadcast.
    """
    import torch.distributed as dist

    from nbaccel import FullyShardedDataParallelPlugin, ProcessState
    from nbaccel.training.fsdp import (
        full_model_state_dict,
        load_full_model_state_dict,
        shard_model,
    )

    device = ProcessState().device
    if not dist.is_initialized():  # one rank: FSDP needs a group even so
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1,
                                **({"device_id": device} if device.type == "cuda" else {}))
    plugin = FullyShardedDataParallelPlugin(min_num_params=1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).to(torch.bfloat16)
    fp32_bytes = 4 * sum(p.numel() for p in model.parameters())
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    model = shard_model(model, plugin, device, 1, [], upcast=True)
    peak = torch.cuda.max_memory_allocated(device) / fp32_bytes if cuda else 0.0
    with torch.device("meta"):
        empty = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))
    empty = shard_model(empty, plugin, device, 1, [])
    def local(state: dict[str, Any]) -> dict[str, torch.Tensor]:  # one rank: torch may leave DTensors ungathered
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone()
                for k, v in state.items()}

    full = local(full_model_state_dict(model))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    load_full_model_state_dict(model, dict(full))  # torch puts the shards into the dict it is given
    again = local(full_model_state_dict(model))
    return {"devices": sorted({str(p.device) for p in [*model.parameters(), *empty.parameters()]}),
            "dtypes": sorted({str(p.dtype) for p in model.parameters()}), "peak": peak,
            "meta_left": sum(p.is_meta for p in empty.parameters()),
            "round_trip": all(torch.equal(full[k], again[k]) for k in full)}


def uuid() -> str:
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def hold_memory_then(folder: str, fail_rank: int | None) -> None:
    from nbaccel import ProcessState

    state = ProcessState()
    size = 512 * 2**20 if state.device.type == "cuda" else 1024  # 512 MiB each
    block = torch.empty(size, dtype=torch.uint8, device=state.device)
    block.fill_(1)
    open(os.path.join(folder, f"ready{state.process_index}"), "w").close()
    if state.process_index == fail_rank:
        raise ValueError(f"rank {fail_rank} fails on purpose")
    time.sleep(600)  # stopped by the launcher (a failing rank, or the caller's interrupt)


def fp8_train() -> tuple[float, int]:
    from nbaccel import Accelerator

    accelerator = Accelerator(mixed_precision="fp8")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    for _ in range(3):
        loss = model(torch.randn(32, 64, device=accelerator.device)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    converted = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    return float(loss), converted


def cuda_module() -> nn.Module:
    return nn.Linear(4, 4).cuda()
