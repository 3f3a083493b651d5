"""State resets, unwrapping compiled models, hooks on blocks, layerwise casting and the small model helpers: as in
Accelerate.

One process; each case runs the same code through Accelerate and nbaccel.
"""

from __future__ import annotations

import importlib
import types

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")

LIBRARIES = ["accelerate", "nbaccel"]


def module(library: str, name: str):
    return importlib.import_module(f"{library}.{name}" if name else library)


def reset_then_prepare(library: str, reset_partial_state: bool) -> dict:
    lib, state = module(library, ""), module(library, "state")
    state.AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = lib.Accelerator(cpu=True)
    state.AcceleratorState._reset_state(reset_partial_state=reset_partial_state)
    try:
        accelerator.prepare(nn.Linear(1, 1))
        first = "prepared"
    except AttributeError as exc:
        first = "AttributeError: " + str(exc).split(". ", 1)[1]
    partial = "works" if reset_partial_state else repr(state.PartialState().num_processes)
    again = lib.Accelerator(cpu=True)  # a new Accelerator sets the state up again, the old one too
    prepared = type(again.prepare(nn.Linear(1, 1))).__name__, type(accelerator.prepare(nn.Linear(1, 1))).__name__
    state.AcceleratorState._reset_state(reset_partial_state=True)
    return {"first": first, "partial state": partial, "after a new Accelerator": prepared}


@pytest.mark.parametrize("reset_partial_state", [False, True])
def test_reset_state_under_a_live_accelerator_makes_prepare_raise(reset_partial_state):
    theirs, ours = (reset_then_prepare(lib, reset_partial_state) for lib in LIBRARIES)
    assert ours == theirs
    assert ours["first"].startswith("AttributeError: This happens if `AcceleratorState._reset_state()` was called")


def after_reset(library: str) -> dict:
    lib, state = module(library, ""), module(library, "state")
    state.AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = lib.Accelerator(cpu=True)
    state.AcceleratorState._reset_state()
    seen = {}
    for name in ("is_main_process", "is_local_main_process", "is_last_process", "use_distributed", "initialized",
                 "num_processes", "process_index", "local_process_index", "device", "distributed_type",
                 "mixed_precision"):
        try:
            seen[name] = repr(getattr(accelerator.state, name))
        except AttributeError:
            seen[name] = "AttributeError"
    seen["accelerator.is_local_main_process"] = accelerator.is_local_main_process
    state.AcceleratorState._reset_state(reset_partial_state=True)
    return seen


def test_after_reset_state_the_process_flags_keep_working_as_in_accelerate():
    """Accelerate's ``test_metrics`` asks ``accelerator.is_local_main_process`` after ``_reset_state()``."""
    theirs, ours = (after_reset(lib) for lib in LIBRARIES)
    assert ours == theirs
    assert ours["is_local_main_process"] == "True" and ours["num_processes"] == "AttributeError"


def unwrapped(library: str) -> dict:
    extract = module(library, "utils").extract_model_from_parallel
    inner = nn.Linear(2, 2)
    compiled_parallel = torch.compile(nn.DataParallel(inner), backend="eager")
    kept = extract(compiled_parallel, keep_torch_compile=True)
    x = torch.ones(1, 2)
    return {"kept": (type(kept).__name__, kept._orig_mod is inner, torch.equal(kept(x), inner(x))),
            "dropped": extract(compiled_parallel, keep_torch_compile=False) is inner,
            "plain": [type(extract(torch.compile(inner, backend="eager"), keep_torch_compile=k)).__name__
                      for k in (True, False)]}


def test_extract_model_from_parallel_keeps_the_compile_wrapping():
    theirs, ours = (unwrapped(lib) for lib in LIBRARIES)
    assert ours == theirs == {"kept": ("OptimizedModule", True, True), "dropped": True,
                              "plain": ["OptimizedModule", "Linear"]}


def blocks_hooked(library: str) -> dict:
    hooks = module(library, "hooks")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 2))
    x = torch.randn(2, 3)
    reference = model(x)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    hooks.attach_align_device_hook_on_blocks(model, execution_device={"": "cpu", "0": "cpu", "1": "cpu", "2": "cpu"},
                                             offload={"": False, "0": False, "1": True, "2": False},
                                             weights_map=weights)
    hooked = sorted(name for name, m in model.named_modules() if hasattr(m, "_hf_hook"))
    return {"hooked": hooked, "devices": {n: p.device.type for n, p in model.named_parameters()},
            "same output": torch.allclose(model(x), reference)}


def test_attach_align_device_hook_on_blocks_hooks_the_same_modules():
    theirs, ours = (blocks_hooked(lib) for lib in LIBRARIES)
    assert ours == theirs
    assert ours["devices"]["1.0.weight"] == "meta" and ours["same output"]


def cast(library: str) -> dict:
    big_modeling = module(library, "big_modeling")
    model = nn.Sequential(nn.Linear(2, 4), nn.LayerNorm(4), nn.Sequential(nn.Conv1d(1, 1, 1), nn.Linear(4, 4)),
                          nn.Embedding(3, 4))
    big_modeling.attach_layerwise_casting_hooks(model, torch.bfloat16, torch.float32,
                                                skip_modules_pattern=["^0$", r"2\.1"],
                                                skip_modules_classes=(nn.Conv1d,))
    return {"dtypes": {n: str(p.dtype) for n, p in model.named_parameters()},
            "layers": [c.__name__ for c in big_modeling.SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING]}


def test_layerwise_casting_skips_the_same_layers():
    theirs, ours = (cast(lib) for lib in LIBRARIES)
    assert ours == theirs
    assert ours["dtypes"] == {"0.weight": "torch.float32", "0.bias": "torch.float32", "1.weight": "torch.float32",
                              "1.bias": "torch.float32", "2.0.weight": "torch.float32", "2.0.bias": "torch.float32",
                              "2.1.weight": "torch.float32", "2.1.bias": "torch.float32",
                              "3.weight": "torch.float32"}


def small_helpers(library: str) -> dict:
    u = module(library, "utils")
    transformers_v4 = types.SimpleNamespace(tp_size=4)
    transformers_v5 = types.SimpleNamespace(tp_size=None,
                                            config=types.SimpleNamespace(distributed_config={"tp_size": 2}))
    return {"tp": [u.get_model_tp_size(m) for m in (transformers_v4, transformers_v5, nn.Linear(1, 1))],
            "dtensor": u.model_has_dtensor(nn.Linear(1, 1)),
            "pretty": [u.get_pretty_name(x) for x in (nn.Linear, nn.Linear(1, 1), u.get_pretty_name)],
            "initialized": u.are_libraries_initialized("torch", "surely_not_a_module"),
            "tied in config": u.check_tied_parameters_in_config(nn.Linear(1, 1)),
            "bytes": [u.dtype_byte_size(d) for d in (u.CustomDtype.FP8, u.CustomDtype.INT4, u.CustomDtype.INT2)],
            "device type": u.get_current_device_type(), "backend": u.get_distributed_backend("cuda"),
            "tqdm": sum(u.tqdm(range(4), disable=True)),
            "shard is stateful": issubclass(module(library, "data_loader").DataLoaderShard,
                                            module(library, "data_loader").DataLoaderStateMixin),
            "do_nothing": module(library, "state").do_nothing(1, a=2),
            "compiled": [u.is_compiled_module(torch.compile(nn.Linear(1, 1), backend="eager")),
                         u.is_compiled_module(nn.Linear(1, 1)),
                         u.has_compiled_regions(nn.Sequential(torch.compile(nn.Linear(1, 1), backend="eager"))),
                         u.has_compiled_regions(nn.Sequential(nn.Linear(1, 1)))]}


def test_small_helpers_answer_the_same():
    theirs, ours = (small_helpers(lib) for lib in LIBRARIES)
    assert ours == theirs
    assert ours["tp"] == [4, 2, None] and ours["bytes"] == [1, 0.5, 0.25]
    assert ours["compiled"] == [True, False, True, False]


def warned_on_creation(library: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                       release: str) -> bool:
    import platform
    import warnings

    real = platform.uname()
    monkeypatch.setattr(platform, "uname", lambda: real._replace(release=release))
    lib, state = module(library, ""), module(library, "state")
    state.AcceleratorState._reset_state(reset_partial_state=True)
    caplog.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lib.Accelerator(cpu=True)
    state.AcceleratorState._reset_state(reset_partial_state=True)
    messages = [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records]
    return any("below the recommended minimum of 5.5.0" in m for m in messages)


@pytest.mark.parametrize("release,warns", [("4.19.0-generic", True), ("6.8.0-generic", False)])
def test_an_old_kernel_is_warned_about_when_an_accelerator_is_made(monkeypatch, caplog, release, warns):
    caplog.set_level("WARNING")
    assert [warned_on_creation(lib, monkeypatch, caplog, release) for lib in LIBRARIES] == [warns, warns]
