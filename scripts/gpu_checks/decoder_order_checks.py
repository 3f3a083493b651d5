"""The streamed offload on a transformers decoder, run by ``scripts/check_gpu_loading.py``: the
order the model runs in is learned, each decoder layer is one group, and every offloaded byte
crosses once per forward, also across ``generate()`` steps; tokens match the model held whole.

On CUDA the model is loaded with ``load_checkpoint_and_dispatch`` (layers and head on the CPU,
the rest on GPU 0), so dispatch itself streams; with ``--cpu`` it is offloaded with
``cpu_offload`` and streamed by hand on the CPU (synchronous copies), the same engine.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch import nn

__all__ = ["check_decoder_order"]


def _check(name: str, condition: bool, detail: object = "") -> None:
    if not condition:
        raise SystemExit(f"FAILED: {name} {detail}")
    print(f"ok   {name} {detail}", flush=True)


def _config(device: torch.device):  # noqa: ANN202 - a LlamaConfig
    import transformers

    big = device.type == "cuda"  # layers of 32 MiB on a GPU: copies worth overlapping
    return transformers.LlamaConfig(vocab_size=4096 if big else 128, hidden_size=1024 if big else 64,
                                    intermediate_size=2816 if big else 128, num_hidden_layers=6,
                                    num_attention_heads=8 if big else 4, num_key_value_heads=8 if big else 2,
                                    max_position_embeddings=512, tie_word_embeddings=False)


def _offloaded(whole: nn.Module, device: torch.device, folder: Path) -> nn.Module:
    import transformers

    from nbaccel.big_modeling import cpu_offload, init_empty_weights, load_checkpoint_and_dispatch
    from nbaccel.big_modeling.offload_groups import stream_model

    if device.type == "cpu":
        model = transformers.LlamaForCausalLM(whole.config).eval()
        model.load_state_dict(whole.state_dict())
        model = cpu_offload(model, "cpu")
        stream_model(model, device, cap=2**40)
        return model
    whole.save_pretrained(folder, safe_serialization=True)
    with init_empty_weights():
        model = transformers.LlamaForCausalLM(whole.config).eval()
    layers = whole.config.num_hidden_layers
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 0, "lm_head": "cpu",
                  **{f"model.layers.{i}": "cpu" for i in range(layers)}}
    return load_checkpoint_and_dispatch(model, folder, device_map, show_progress=False)


def _ring(model: nn.Module):  # noqa: ANN202 - the model's SlotRing
    for module in model.modules():
        streamed = getattr(getattr(module, "_hf_hook", None), "streamed", None)
        if streamed is not None:
            return streamed.offload.ring
    raise SystemExit("FAILED: the offloaded decoder does not stream")


def check_decoder_order(device: torch.device) -> None:
    """Run the checks above on ``device`` (``cuda:0``, or ``cpu`` for a dry run)."""
    import transformers

    from nbaccel.big_modeling import offload_report

    torch.manual_seed(0)
    whole = transformers.LlamaForCausalLM(_config(device)).eval()
    ids = torch.randint(0, whole.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # on the same device: the same kernels give the same bits
        on = ids.to(device)
        expected = whole.to(device).generate(on, attention_mask=torch.ones_like(on), max_new_tokens=6,
                                             do_sample=False, pad_token_id=0).cpu()
        whole.to("cpu")
    with tempfile.TemporaryDirectory() as tmp:
        model = _offloaded(whole, device, Path(tmp))
        ring = _ring(model)
        layers = whole.config.num_hidden_layers
        _check("a decoder layer is one group (its norms, attention and MLP copied together)",
               ring.groups in (layers + 1, layers + 3), f"({ring.groups} groups for {layers} layers)")
        steps = []
        model.register_forward_hook(lambda *_: steps.append((ring.current.copies, ring.current.misses)))
        x = ids.to(device)
        with torch.no_grad():
            model(x)
            model(x)
            second = steps[-1]
            tokens = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=6,
                                    do_sample=False, pad_token_id=0)
        _check("each offloaded group is copied once per forward, none missed, in the order the model runs",
               second == (ring.groups, 0), f"(copies, misses) = {second} for {ring.groups} groups")
        later = steps[3:]
        _check("generate(): every step after the first copies each group once and starts warm",
               later and all(s == (ring.groups, 0) for s in later), f"({steps[2:]})")
        _check("generate(): the same tokens as the model held whole", torch.equal(tokens.cpu(), expected),
               f"({tokens.shape[1] - ids.shape[1]} new tokens)")
        report = offload_report(model)
        _check("offload_report after generate()", report.copies == ring.groups and report.misses == 0,
               f"({report})")
