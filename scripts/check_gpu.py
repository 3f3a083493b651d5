"""Check nbaccel's CUDA paths on a machine with GPUs (this repository's CI has none).

Run: ``python scripts/check_gpu.py``. Each check prints ``ok`` or raises; the whole run takes
well under a minute on one GPU. It covers what the CPU test suite cannot:

1. GPUs are counted without initializing CUDA in the parent; fork is chosen while CUDA is idle.
2. ``notebook_launcher`` on every GPU: NCCL all_reduce, one device per rank.
3. The Accelerator on CUDA: DDP step, fp16 with GradScaler, bf16 autocast, gather.
4. Spawn is chosen (with its note) once CUDA is initialized in the parent, and still works.
5. Big-model dispatch: ``device_map="auto"`` puts blocks on ``cuda:0``, then CPU, then disk (weights
   mapped from the checkpoint and moved to the GPU per layer); the output matches the full model.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
from torch import nn


def _check(name: str, condition: bool, detail: object = "") -> None:
    if not condition:
        raise SystemExit(f"FAILED: {name} {detail}")
    print(f"ok   {name} {detail}")


def _nccl_rank() -> tuple[int, str, float]:
    import torch.distributed as dist

    from nbaccel import ProcessState

    state = ProcessState()
    value = torch.ones(1, device=state.device) * (state.process_index + 1)
    dist.all_reduce(value)
    return state.process_index, str(state.device), value.item()


def _train(mixed_precision: str) -> tuple[str, float, bool]:
    from torch.utils.data import DataLoader, TensorDataset

    from nbaccel import Accelerator

    accelerator = Accelerator(mixed_precision=mixed_precision)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 16), torch.randn(256, 1))
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=16))
    for xb, yb in loader:
        loss = nn.functional.mse_loss(model(xb), yb)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    gathered = accelerator.gather(loss.detach().reshape(1))
    return str(accelerator.device), float(gathered.mean()), bool(torch.isfinite(gathered).all())


def main() -> None:
    """Run every check."""
    from nbaccel import notebook_launcher
    from nbaccel.environment import cuda_device_count, fork_unsafe_reason

    gpus = cuda_device_count()
    _check("GPUs counted without initializing CUDA", gpus > 0 and not torch.cuda.is_initialized(), f"({gpus})")
    _check("fork is safe while CUDA is idle", fork_unsafe_reason() is None)

    results = notebook_launcher(_nccl_rank, num_processes=gpus, return_all=True)
    expected = gpus * (gpus + 1) / 2
    _check("NCCL all_reduce on every GPU", all(v[2] == expected for v in results.values()), results)
    _check("one device per rank", len({v[1] for v in results.values()}) == gpus)

    for precision in ("no", "fp16", "bf16"):
        device, loss, finite = notebook_launcher(_train, (precision,), num_processes=gpus)
        _check(f"Accelerator on CUDA, mixed_precision={precision}", device.startswith("cuda") and finite,
               f"loss {loss:.4f}")

    torch.zeros(1, device="cuda")  # initialize CUDA in the parent: fork is now unsafe
    _check("fork becomes unsafe after CUDA init", fork_unsafe_reason() is not None, fork_unsafe_reason())
    results = notebook_launcher(_nccl_rank, num_processes=gpus, return_all=True)
    _check("spawn works with CUDA initialized in the parent", all(v[2] == expected for v in results.values()))

    from nbaccel import init_empty_weights, load_checkpoint_and_dispatch

    torch.manual_seed(0)
    full = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)]).eval()
    with tempfile.TemporaryDirectory() as folder:
        from safetensors.torch import save_file

        path = os.path.join(folder, "model.safetensors")
        save_file(full.state_dict(), path)
        with init_empty_weights():
            empty = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
        model = load_checkpoint_and_dispatch(empty, path, device_map="auto",
                                             max_memory={0: "600KiB", "cpu": "600KiB"}, offload_folder=folder)
        x = torch.randn(4, 256)
        with torch.no_grad():
            same = torch.allclose(model(x.cuda()).cpu(), full(x), atol=1e-5)
        where = set(model.hf_device_map.values())
        _check("big-model dispatch: GPU first, then CPU, then disk; output matches",
               same and {0, "cpu", "disk"} <= where, model.hf_device_map)
    print("all GPU checks passed")


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("no CUDA device here: run this on a GPU machine")
    main()
