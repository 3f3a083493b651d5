"""Each offloaded byte moves once per forward, in the order the model runs: transformers Llama and
GPT-2 built from small configs (nothing downloaded), offloaded and streamed through the real
engine on CPU (synchronous copies), against the same model held whole."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nbaccel.big_modeling import cpu_offload, offload_report
from nbaccel.big_modeling.offload_groups import stream_model
from nbaccel.big_modeling.slot_ring import PassStats

transformers = pytest.importorskip("transformers")
CPU = torch.device("cpu")
LAYERS = 3


def _llama() -> nn.Module:
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=LAYERS, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=LAYERS, n_head=4, n_positions=64)
    return transformers.GPT2LMHeadModel(config)


def _pair(make) -> tuple[nn.Module, nn.Module]:  # a model builder
    torch.manual_seed(0)
    whole = make().eval()
    offloaded = make().eval()
    offloaded.load_state_dict(whole.state_dict())
    offloaded = cpu_offload(offloaded, "cpu")
    assert stream_model(offloaded, CPU, cap=2**30) == []
    return whole, offloaded


def _ring(model: nn.Module):  # the model's SlotRing
    hooks = [m._hf_hook for m in model.modules() if getattr(getattr(m, "_hf_hook", None), "streamed", None)]
    return hooks[0].streamed.offload.ring


def _per_forward(model: nn.Module) -> list[PassStats]:
    """Each forward's copy statistics, as the forward ends (generate() runs one per token)."""
    ring, seen = _ring(model), []
    model.register_forward_hook(lambda *_: seen.append(PassStats(**vars(ring.current))))
    return seen


@pytest.mark.parametrize("make", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_each_block_is_copied_once_per_forward_and_never_missed_after_the_first(make) -> None:
    whole, model = _pair(make)
    ring = _ring(model)
    # a group per decoder block, plus the embeddings, the final norm and the head
    assert ring.groups == LAYERS + (3 if make is _llama else 4)  # GPT-2 has position embeddings
    forwards = _per_forward(model)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = whole(ids).logits
        outs = [model(ids).logits for _ in range(3)]
    assert all(torch.equal(o, expected) for o in outs)
    assert [f.acquired for f in forwards] == [ring.groups] * 3
    later = forwards[1:]
    assert [(f.copies, f.misses) for f in later] == [(ring.groups, 0)] * 2


@pytest.mark.parametrize("make", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_generate_walks_the_same_order_every_step_and_starts_each_step_warm(make) -> None:
    whole, model = _pair(make)
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        expected = whole.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                  pad_token_id=0)
    forwards = _per_forward(model)
    with torch.no_grad():
        tokens = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                pad_token_id=0)
    assert torch.equal(tokens, expected)
    groups = _ring(model).groups
    assert len(forwards) == 5
    assert [(f.copies, f.misses) for f in forwards[1:]] == [(groups, 0)] * 4


def test_the_report_after_a_forward_says_what_crossed_and_where_the_time_went() -> None:
    _, model = _pair(_llama)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids)
        model(ids)
    report = offload_report(model)
    assert report.copies == report.groups and report.misses == 0
    # an untied Llama: every weight crosses once (its rotary buffer stays on the device)
    assert report.bytes_per_forward == sum(p.numel() * p.element_size() for p in _llama().parameters())
    assert report.bus_bytes_per_s is None and report.bus_limit_s is None
    assert 0 < report.copy_wait_s <= report.forward_s and report.achieved_bytes_per_s > 0
    text = str(report)
    assert "MiB moved" in text and "bus n/a" in text and "copy wait" in text and "compute" in text


def test_the_report_says_why_when_there_is_nothing_to_report() -> None:
    from nbaccel.errors import EnvironmentStateError

    plain = cpu_offload(_llama().eval(), "cpu")  # offloaded, but not streaming (no GPU here)
    with pytest.raises(EnvironmentStateError, match="streams no offloaded weights") as info:
        offload_report(plain)
    assert "Fix:" in str(info.value)
    _, model = _pair(_llama)
    with pytest.raises(EnvironmentStateError, match="has not run an offloaded forward"):
        offload_report(model)
    model(torch.zeros(1, 3, dtype=torch.long))  # gradients enabled: the plain way, nothing streamed
    with pytest.raises(EnvironmentStateError, match="has not run an offloaded forward"):
        offload_report(model)
