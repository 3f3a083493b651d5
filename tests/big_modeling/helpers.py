"""The one copy of each tiny model the big-modeling tests use, and checkpoint writers for them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import safetensors.torch
import torch
from torch import nn

VOCAB, WIDTH, BLOCKS = 32, 16, 4


class Block(nn.Module):
    """A residual MLP block with a persistent buffer (saved in checkpoints)."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.register_buffer("gate", torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x)))) * self.gate


class TinyLM(nn.Module):
    """A tied-embedding language model of identical blocks.

    ``head.weight`` is ``embed.weight`` (checkpoints store it once, as ``embed.weight``), and
    ``positions`` is a non-persistent buffer computed at construction (no checkpoint has it).
    With ``tied=False`` the head has weights of its own.
    """

    def __init__(self, vocab: int = VOCAB, width: int = WIDTH, blocks: int = BLOCKS,
                 tied: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.register_buffer("positions", torch.arange(64, dtype=torch.float32)[:, None] / 64,
                             persistent=False)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.positions[: ids.shape[-1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_model(seed: int = 0, **kwargs: int | bool) -> TinyLM:
    """A TinyLM with random, non-trivial weights (norms and buffers perturbed too)."""
    torch.manual_seed(seed)
    model = TinyLM(**kwargs)
    with torch.no_grad():
        for t in model.state_dict(keep_vars=True).values():
            if t.is_floating_point():
                t.add_(torch.randn_like(t) * 0.1)
    return model.eval()


def sample_ids(seed: int = 1, length: int = 8) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))


def stored_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict as checkpoints store it: tied aliases dropped (``head.weight``)."""
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()
            if k != "head.weight"}


def save_safetensors_at(tensors: dict[str, torch.Tensor], path: str | os.PathLike,
                        data_start: int) -> None:
    """Save with the header padded (in ``__metadata__``) so the data starts ``data_start``
    bytes past a multiple of 64: 0 makes every tensor a whole number of 64 bytes in aligned."""
    for pad in range(64):
        safetensors.torch.save_file(tensors, str(path), metadata={"pad": "x" * pad})
        with open(path, "rb") as f:
            if (8 + int.from_bytes(f.read(8), "little")) % 64 == data_start % 64:
                return
    raise AssertionError(f"no padding puts the data of {path} at {data_start} mod 64")


def save_checkpoint(model: nn.Module, folder: str | os.PathLike, kind: str = "safetensors",
                    shards: int = 1, data_start: int | None = None) -> Path:
    """Write ``model`` as one file (returned) or ``shards`` files plus an index (returned).

    ``kind`` is ``"safetensors"`` or ``"bin"``; ``data_start`` places safetensors data (see
    :func:`save_safetensors_at`), else it lands wherever the header ends.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = stored_state(model)
    keys = list(state)
    stem, suffix = ("model", ".safetensors") if kind == "safetensors" else ("pytorch_model",
                                                                              ".bin")

    def write(part: dict[str, torch.Tensor], path: Path) -> None:
        if kind == "safetensors" and data_start is not None:
            save_safetensors_at(part, path, data_start)
        elif kind == "safetensors":
            safetensors.torch.save_file(part, str(path))
        else:
            torch.save(part, path)

    if shards == 1:
        path = folder / f"{stem}{suffix}"
        write(state, path)
        return path
    weight_map = {}
    for i in range(shards):
        name = f"{stem}-{i + 1:05d}-of-{shards:05d}{suffix}"
        part = {k: state[k] for k in keys[i::shards]}
        write(part, folder / name)
        weight_map.update(dict.fromkeys(part, name))
    index = folder / f"{stem}{suffix}.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


def empty_model(**kwargs: int | bool) -> TinyLM:
    from nbaccel.big_modeling import init_empty_weights

    with init_empty_weights():
        return TinyLM(**kwargs).eval()
