"""Checks of big-model inference on GPUs: device maps over two GPUs, offload to CPU and disk, and
loading a checkpoint onto a GPU through pinned staging buffers, bit for bit as ``load_state_dict``.

The functions the checks launch are here too (each runs in a launched worker, so this process
keeps CUDA untouched); ``tests/test_check_gpu_script.py`` runs :func:`pinned_load` on CPU.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpu_checks.runner import Check, expect, launch, registrar

__all__ = ["CHECKS", "device_map_tied", "offload", "pinned_load"]

CHECKS: list[Check] = []
check = registrar(CHECKS)


class _TiedLM(nn.Module):
    """Embedding, residual blocks and a head tied to the embedding."""

    def __init__(self, vocab: int = 512, width: int = 256, blocks: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(blocks))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def device_map_tied() -> tuple[dict[str, Any], bool, bool]:
    """The tied model dispatched over two GPUs by an inferred map: the map, output matching CPU, still tied."""
    from nbaccel import dispatch_model, infer_auto_device_map

    torch.manual_seed(0)
    model = _TiedLM().eval()
    ids = torch.randint(0, 512, (2, 8))
    with torch.no_grad():
        expected = model(ids)
    size = sum(p.numel() * 4 for p in model.parameters())
    budget = {0: int(size * 0.6), 1: int(size * 0.6), "cpu": 10 * size}
    device_map = infer_auto_device_map(model, max_memory=budget, no_split_module_classes=["Sequential"])
    model = dispatch_model(model, device_map)
    with torch.no_grad():
        got = model(ids.to("cuda:0")).cpu()
    tied = model.head.weight is model.embed.weight
    return {str(k): str(v) for k, v in device_map.items()}, bool(torch.allclose(got, expected, atol=1e-4)), tied


def offload(folder: str) -> tuple[dict[str, Any], bool]:
    """A checkpoint dispatched over GPU, CPU and disk: the map, and whether the output matches
    and the disk-offloaded last layer runs on GPU 0."""
    from safetensors.torch import save_file

    from nbaccel import init_empty_weights, load_checkpoint_and_dispatch

    torch.manual_seed(0)
    full = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)]).eval()
    path = os.path.join(folder, "model.safetensors")
    save_file(full.state_dict(), path)
    with init_empty_weights():
        empty = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
    model = load_checkpoint_and_dispatch(empty, path, device_map="auto", max_memory={0: "600KiB", "cpu": "600KiB"},
                                         offload_folder=os.path.join(folder, "offload"))
    x = torch.randn(4, 256)
    with torch.no_grad():
        same = torch.allclose(model(x.cuda()).cpu(), full(x), atol=1e-5)
    # a budget too small for the offload slots keeps the GPU as the execution device (issue 34)
    runs_on = str(model[7]._hf_hook.execution_device)
    return {str(k): str(v) for k, v in model.hf_device_map.items()}, bool(same) and runs_on == "cuda:0"


class _LoadLM(nn.Module):
    """A tied embedding, one wide MLP (at width 4096 its 72 MiB ``up.weight`` spans two 64 MiB
    staging buffers) and a bfloat16 buffer: the shapes and dtypes a checkpoint load meets."""

    def __init__(self, vocab: int = 512, width: int = 4096, wide: int = 4608) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.up = nn.Linear(width, wide)
        self.down = nn.Linear(wide, width)
        self.norm = nn.LayerNorm(width)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width).to(torch.bfloat16))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        x = x + self.down(torch.relu(self.up(x))) * self.scale.to(x.dtype)
        return self.head(self.norm(x))


def _write_shards(model: nn.Module, folder: Path) -> dict[str, torch.Tensor]:
    """Two safetensors shards and an index, as ``save_file`` lays them out (data 8 bytes off 64);
    returns what a plain ``load_file`` of the shards gives."""
    import safetensors.torch

    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k != "head.weight"}
    names, weight_map, loaded = list(state), {}, {}
    for s in range(2):
        file = f"model-{s + 1}-of-2.safetensors"
        safetensors.torch.save_file({n: state[n] for n in names[s::2]}, str(folder / file))
        weight_map.update(dict.fromkeys(names[s::2], file))
        loaded.update(safetensors.torch.load_file(str(folder / file)))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return loaded


def _differences(model: nn.Module, reference: nn.Module, ids: torch.Tensor) -> tuple[list[str], bool]:
    """Names whose tensors differ in any bit (or in dtype or device), and whether outputs are equal."""
    theirs = reference.state_dict()
    differ = [n for n, t in model.state_dict().items()
              if t.dtype != theirs[n].dtype or t.device != theirs[n].device
              or not torch.equal(t.view(torch.uint8), theirs[n].view(torch.uint8))]
    with torch.no_grad():
        return differ, bool(torch.equal(model(ids), reference(ids)))


def pinned_load(folder: str, device: str = "cuda:0", width: int = 4096, wide: int = 4608) -> dict[str, Any]:
    """Load a two-shard checkpoint onto ``device`` with ``load_checkpoint_and_dispatch`` (through
    pinned staging buffers on a GPU), in its dtypes and cast to float16, and compare each with
    a model on ``device`` given the same files by a plain ``load_state_dict``."""
    from nbaccel import init_empty_weights, load_checkpoint_and_dispatch
    from nbaccel.big_modeling.checkpoint_files import SafetensorsFile
    from nbaccel.big_modeling.resident import read_to_device

    torch.manual_seed(0)
    stored = _write_shards(_LoadLM(width=width, wide=wide), Path(folder))
    ids = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(1)).to(device)
    found: dict[str, Any] = {}
    for label, dtype in (("stored", None), ("float16", torch.float16)):
        with init_empty_weights():
            empty = _LoadLM(width=width, wide=wide).eval()
        model = load_checkpoint_and_dispatch(empty, folder, {"": device}, dtype=dtype)
        reference = _LoadLM(width=width, wide=wide).eval().to(device)
        reference = reference if dtype is None else reference.to(dtype)  # buffers too, as dtype= does
        reference.load_state_dict(stored, strict=False)  # head.weight is tied to embed.weight
        found[label] = _differences(model, reference, ids)
        found[f"{label} tied"] = model.head.weight is model.embed.weight
        del model, reference
    infos = [i for f in sorted(Path(folder).glob("*.safetensors")) for i in SafetensorsFile(f).tensors.values()]
    names = [n for f in sorted(Path(folder).glob("*.safetensors")) for n in SafetensorsFile(f).tensors]
    found["chunked exact"] = all(
        torch.equal(t.cpu().view(torch.uint8), stored[n].view(torch.uint8))
        for size in (4096, 2**20) for n, t in zip(names, read_to_device(infos, device, buffer_bytes=size)))
    stats = torch.cuda.host_memory_stats() if device.startswith("cuda") else {}
    found["pinned bytes"] = stats.get("allocated_bytes.peak")
    return found


# --------------------------------------------------------------------------- the checks, in order


@check("device-map-tied", min_gpus=2)
def _tied(gpus: int) -> str:
    device_map, same, tied = launch(device_map_tied, n=1)[0]
    used = set(device_map.values())
    expect({"0", "1"} <= used and same, f"map {device_map}, output matches {same}")
    return (f"tied-embedding model over {sorted(used)}; output matches CPU; head and embedding "
            f"{'still share one Parameter' if tied else 'hold separate copies'}")


@check("big-model-offload")
def _big_model(gpus: int) -> str:
    with tempfile.TemporaryDirectory() as folder:
        device_map, same = launch(offload, folder, n=1)[0]
    expect(same and {"0", "cpu", "disk"} <= set(device_map.values()),
           f"map {device_map}, matches and runs offloaded layers on cuda:0: {same}")
    return "device_map='auto' over GPU, CPU and disk; output matches the full model"


@check("pinned-load")
def _pinned_load(gpus: int) -> str:
    with tempfile.TemporaryDirectory() as folder:
        found = launch(pinned_load, folder, n=1)[0]
    for label in ("stored", "float16"):
        differ, outputs_equal = found[label]
        expect(not differ and outputs_equal and found[f"{label} tied"],
               f"{label} dtype: tensors differing from load_state_dict {differ}, outputs equal {outputs_equal}, "
               f"tied {found[f'{label} tied']}")
    expect(found["chunked exact"], "read_to_device with 4 KiB and 1 MiB staging buffers changed some bytes")
    expect(found["pinned bytes"] != 0, f"no pinned host memory was allocated ({found['pinned bytes']})")
    pinned = "n/a" if found["pinned bytes"] is None else f"{found['pinned bytes'] / 2**20:.0f} MiB"
    return ("load_checkpoint_and_dispatch onto cuda:0 (2 shards, 72 MiB tensor over two staging buffers, "
            "bf16 buffer, tied head) bit-identical to load_state_dict, as stored and cast to fp16; "
            f"peak pinned {pinned}")
