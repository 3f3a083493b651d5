"""Device maps over a zoo of transformers models: nbaccel's map is Accelerate's, budget by budget.

The models are built from configs on this machine (tiny sizes, nothing downloaded), with tied and
untied heads; budgets cover CPU only, CPU and disk, and two GPUs planned on this CPU-only machine
(GPU budgets are arithmetic: neither library touches CUDA to plan them).
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

import nbaccel.hardware
from nbaccel.big_modeling import compute_module_sizes, infer_auto_device_map
from nbaccel.big_modeling.device_map import check_device_map
from nbaccel.big_modeling.map_devices import device_for

accelerate_utils = pytest.importorskip("accelerate.utils")
transformers = pytest.importorskip("transformers")

SMALL = {"gpt2": dict(n_embd=32, n_layer=4, n_head=2, vocab_size=96, n_positions=32),
         "llama": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                       num_attention_heads=2, num_key_value_heads=1, vocab_size=96),
         "t5": dict(d_model=32, d_ff=64, d_kv=8, num_layers=3, num_decoder_layers=2, num_heads=2,
                    vocab_size=96),
         "bert": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=2, vocab_size=96, max_position_embeddings=32),
         "vit": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                     num_attention_heads=2, image_size=16, patch_size=4, num_labels=5)}
HEADS = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
         "t5": "T5ForConditionalGeneration", "bert": "BertForMaskedLM",
         "vit": "ViTForImageClassification"}
ZOO = [("gpt2", True), ("gpt2", False), ("llama", True), ("llama", False), ("t5", True),
       ("t5", False), ("bert", True), ("vit", False)]


@functools.cache
def build(kind: str, tied: bool) -> torch.nn.Module:
    config_class = transformers.AutoConfig.for_model(kind).__class__
    config = config_class(**SMALL[kind], tie_word_embeddings=tied)
    torch.manual_seed(0)
    return getattr(transformers, HEADS[kind])(config).eval()


def budgets(total: int, block: int) -> list[dict]:
    """CPU-only and two-GPU budgets around the model's size (``total``) and one block's."""
    return [{"cpu": 2 * total}, {"cpu": total}, {"cpu": total // 2}, {"cpu": block},
            {"cpu": total // 3, "disk": total},
            {0: total // 2, 1: total // 2, "cpu": total},
            {0: total // 3, 1: total // 4, "cpu": total // 4},
            {0: block + 1000, 1: total, "cpu": 10 * total},
            {0: 0, 1: total // 2, "cpu": total // 2},
            {0: total * 2, 1: total, "cpu": total}]


@pytest.fixture
def two_fake_gpus(monkeypatch):
    monkeypatch.setattr(nbaccel.hardware, "cuda_device_count", lambda: 2)
    yield
    assert not torch.cuda.is_initialized()


def maps(model, budget, **kwargs):
    with warnings.catch_warnings(record=True) as theirs_warned:
        warnings.simplefilter("always")
        try:
            theirs = dict(accelerate_utils.infer_auto_device_map(model, dict(budget), **kwargs))
        except IndexError:  # Accelerate's lookup of a tied holder already placed
            theirs = None
    with warnings.catch_warnings(record=True) as ours_warned:
        warnings.simplefilter("always")
        ours = infer_auto_device_map(model, dict(budget), **kwargs)
    if theirs is not None:
        assert bool(theirs_warned) == bool(ours_warned)  # the offloaded-buffers warning
    return theirs, ours


@pytest.mark.parametrize("kind,tied", ZOO)
def test_zoo_maps_are_accelerates(two_fake_gpus, kind, tied):
    model = build(kind, tied)
    no_split = list(model._no_split_modules or [])
    total = compute_module_sizes(model)[""]
    block = max(compute_module_sizes(m)[""] for m in model.modules()
                if type(m).__name__ in no_split)
    compared, crashed = 0, []
    for budget in budgets(total, block):
        for kwargs in [{}, {"no_split_module_classes": no_split},
                       {"no_split_module_classes": no_split, "dtype": torch.float16},
                       {"offload_buffers": True}, {"fallback_allocation": True},
                       {"no_split_module_classes": no_split, "fallback_allocation": True},
                       {"clean_result": False}]:
            theirs, ours = maps(model, budget, **kwargs)
            if theirs is None:  # nbaccel still gives a map that covers the model
                crashed.append((budget, kwargs))
                assert check_device_map(model, ours)
                continue
            assert ours == theirs, (budget, kwargs)
            compared += 1
    assert compared + len(crashed) == 70 and compared >= 55, crashed


@pytest.mark.parametrize("kind,tied", [("gpt2", True), ("t5", True), ("llama", False)])
def test_zoo_maps_cover_the_model_and_tied_weights_share_a_device(two_fake_gpus, kind, tied):
    model = build(kind, tied)
    total = compute_module_sizes(model)[""]
    device_map = infer_auto_device_map(model, {0: total // 3, 1: total // 3, "cpu": total},
                                       list(model._no_split_modules))
    assert len(set(device_map.values())) > 1  # the model is really spread
    assert check_device_map(model, device_map) == device_map
    for group in accelerate_utils.find_tied_parameters(model):
        devices = {device_for(n, device_map) for n in group}
        assert len(devices) == 1, group


def test_a_config_that_ties_weights_left_untied_is_reported(two_fake_gpus, caplog):
    model = build("gpt2", True)
    untied = type(model)(model.config)
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    caplog.set_level("WARNING")
    logged = []
    for infer in (accelerate_utils.infer_auto_device_map, infer_auto_device_map):
        caplog.clear()
        infer(untied, {"cpu": 10**9})
        logged.append(any("tie" in r.getMessage() for r in caplog.records))
        caplog.clear()
        infer(model, {"cpu": 10**9})
        logged.append(any("tie" in r.getMessage() for r in caplog.records))
    assert logged == [True, False, True, False]
