"""The transformers Llama case of ``benchmarks/big_model_gpu.py``: offloaded prefill and greedy
generation, nbaccel against Accelerate, on one GPU.

A ``LlamaForCausalLM`` of about 6 GiB in bf16 (14 layers of a 7B-shaped decoder) is built from a
config with random weights and written as 6 safetensors shards (nothing downloaded). Each library,
in a fresh process, interleaved over the rounds, loads it with ``device_map="auto"`` and
``max_memory={0: a quarter of the model, "cpu": plenty}`` (the rest offloaded to the CPU), then
times a prefill of ``PROMPT`` tokens (median of 3 after a first) and a greedy generation of
``NEW_TOKENS`` tokens. The bus limit is the offloaded bytes over the measured pinned
host-to-device rate: a prefill must move them once, and so must every generated token.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

SHARDS = 6
PROMPT = 512
NEW_TOKENS = 16
NO_SPLIT = ["LlamaDecoderLayer"]


def llama_config(layers: int = 14, hidden: int = 4096, intermediate: int = 11008,
                 vocab: int = 32000) -> dict:
    """A 7B-shaped Llama config (about 6 GiB in bf16 at 14 layers), as keyword arguments."""
    return {"vocab_size": vocab, "hidden_size": hidden, "intermediate_size": intermediate,
            "num_hidden_layers": layers, "num_attention_heads": max(1, hidden // 128),
            "num_key_value_heads": max(1, hidden // 128), "max_position_embeddings": 4096,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def budget(total: int, gpu: bool = True) -> dict:
    """``max_memory`` for both libraries, in bytes (ints: neither library parses ``"123B"``):
    a quarter of the model on GPU 0, the rest on the CPU (without ``gpu``: a quarter on the CPU,
    the rest on disk, for a dry run on a CPU machine)."""
    return {0: total // 4, "cpu": 4 * total + 2**30} if gpu else {"cpu": total // 4}


def write_llama(root: Path, config: dict) -> tuple[Path, int]:
    """A random-weight checkpoint of the Llama ``config`` in ``root``; returns it and its bytes."""
    import safetensors.torch
    import transformers

    cfg = transformers.LlamaConfig(**config)
    with torch.device("meta"):
        shapes = {n: t.shape for n, t in transformers.LlamaForCausalLM(cfg).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    names, weight_map, total = list(shapes), {}, 0
    per = -(-len(names) // SHARDS)
    for s in range(SHARDS):
        part = {}
        for name in names[s * per:(s + 1) * per]:
            if name.endswith("norm.weight"):
                part[name] = torch.ones(shapes[name], dtype=torch.bfloat16)
            else:
                part[name] = (torch.randn(shapes[name], generator=gen) * 0.02).to(torch.bfloat16)
        file = f"model-{s + 1:05d}-of-{SHARDS:05d}.safetensors"
        safetensors.torch.save_file(part, str(root / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
        total += sum(t.nbytes for t in part.values())
    cfg.save_pretrained(root)
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return root, total


def _offloaded_bytes(model: torch.nn.Module) -> int:
    from nbaccel.big_modeling.map_devices import device_for

    placed = model.hf_device_map
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters(remove_duplicate=False)
               if device_for(n, placed) in ("cpu", "disk"))


def _synced(fn) -> tuple[float, object]:  # noqa: ANN001 - a callable
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    value = fn()
    sync()
    return time.perf_counter() - start, value


def worker(lib: str, folder: str, out: str, device: str = "cuda", prompt: int = PROMPT) -> dict:
    """Load, prefill and generate with one library, in this (fresh) process (``device="cpu"``:
    a dry run, offloading to disk)."""
    import transformers

    if lib == "nbaccel":
        from nbaccel.big_modeling import init_empty_weights, load_checkpoint_and_dispatch
    else:
        from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    cfg = transformers.AutoConfig.from_pretrained(folder)
    total = json.loads((Path(folder) / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    with init_empty_weights():
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    load_s, model = _synced(lambda: load_checkpoint_and_dispatch(
        model, folder, device_map="auto", max_memory=budget(total, device != "cpu"), no_split_module_classes=NO_SPLIT,
        dtype=torch.bfloat16))
    ids = torch.randint(0, cfg.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(1)).to(device)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        first, _ = _synced(lambda: model(ids))
        prefill = [_synced(lambda: model(ids))[0] for _ in range(3)]
        report = ""
        if lib == "nbaccel" and device != "cpu":  # the CPU streams nothing (no copy stream)
            from nbaccel.big_modeling import offload_report
            report = str(offload_report(model))
        gen_s, tokens = _synced(lambda: model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                                                       do_sample=False, pad_token_id=0))
    new = tokens[0, prompt:].tolist()
    (Path(out) / f"llama-tokens-{lib}-{os.getpid()}.json").write_text(json.dumps(new))
    return {"load_s": load_s, "first_s": first, "prefill_s": sorted(prefill)[1], "generate_s": gen_s,
            "tokens": len(new), "offloaded": _offloaded_bytes(model), "report": report}
