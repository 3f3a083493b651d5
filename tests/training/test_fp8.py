"""fp8: the worker's device check and torchao's layer conversion (fp8 matmuls themselves need an sm89+ GPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nbaccel.errors import ConfigError
from nbaccel.training.fp8 import (
    check_fp8_device,
    convert_model_to_fp8,
    fp8_layer_filter,
)


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 24), nn.Linear(24, 32),
                         nn.Linear(32, 16))


def test_first_last_and_odd_sized_linears_stay_high_precision():
    model = _model()
    keep = fp8_layer_filter(model)
    assert [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and keep(m, name)] == ["2"]


def test_convert_swaps_the_chosen_layers_for_float8linear():
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    model = convert_model_to_fp8(_model())
    assert [name for name, m in model.named_modules() if isinstance(m, Float8Linear)] == ["2"]


@pytest.mark.parametrize(("capability", "ok"), [((8, 6), False), ((8, 9), True)])
def test_the_worker_checks_its_own_gpu(monkeypatch, capability, ok):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr("nbaccel.fp8_support.importlib.util.find_spec", lambda name: object())
    if ok:
        check_fp8_device(torch.device("cuda", 0))
    else:
        with pytest.raises(ConfigError, match=r"this process's device \(cuda:0\) has compute capability 8.6"):
            check_fp8_device(torch.device("cuda", 0))


def test_fp8_with_deepspeed_is_refused(monkeypatch):
    import nbaccel

    monkeypatch.setattr("nbaccel.training.fp8.check_fp8_device", lambda device: None)
    monkeypatch.setattr("nbaccel.training.accelerator.resolve_deepspeed_plugin", lambda plugin, settings: object())
    with pytest.raises(ConfigError, match="not supported with DeepSpeed"):
        nbaccel.Accelerator(mixed_precision="fp8")
