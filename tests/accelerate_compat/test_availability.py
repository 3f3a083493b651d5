"""Accelerate's availability probes give Accelerate's answers on this machine."""

from __future__ import annotations

import importlib

import pytest
import torch

from nbaccel.errors import ConfigError

pytest.importorskip("accelerate")

PROBES = ["is_bf16_available", "is_cuda_available", "is_datasets_available", "is_deepspeed_available",
          "is_fp16_available", "is_import_timer_available", "is_lomo_available", "is_matplotlib_available",
          "is_mps_available", "is_pandas_available", "is_peft_available", "is_pynvml_available", "is_pytest_available",
          "is_rich_available", "is_schedulefree_available", "is_timm_available", "is_torch_xla_available",
          "is_torchdata_available", "is_torchdata_stateful_dataloader_available", "is_torchvision_available",
          "is_transformers_available", "is_triton_available"]


@pytest.mark.parametrize("name", PROBES)
def test_each_probe_answers_as_accelerate_does(name):
    theirs = getattr(importlib.import_module("accelerate.utils"), name)()
    ours = getattr(importlib.import_module("nbaccel.utils"), name)()
    assert ours is bool(theirs)  # Accelerate answers None for some missing packages; nbaccel always a bool


def test_installed_packages_are_seen():
    from nbaccel.utils import is_datasets_available, is_pytest_available

    assert is_pytest_available() is True
    assert is_datasets_available() is (importlib.util.find_spec("datasets") is not None)


@pytest.mark.parametrize("args", [(">=", "2.0"), ("<", "2.0"), ("==", torch.__version__.split("+")[0]), ("!=", "1.0")])
def test_version_comparisons_match(args):
    from accelerate.utils import compare_versions as their_compare
    from accelerate.utils import is_torch_version as theirs

    from nbaccel.utils import compare_versions, is_torch_version

    assert is_torch_version(*args) == theirs(*args)
    assert compare_versions("numpy", *args) == their_compare("numpy", *args)


def test_bad_operation_and_conflicting_checks_are_refused():
    from nbaccel.utils import compare_versions, is_torch_xla_available

    with pytest.raises(ConfigError) as info:
        compare_versions("torch", "=>", "2.0")
    assert info.value.key == "operation" and ">=" in info.value.valid
    with pytest.raises(ConfigError):
        is_torch_xla_available(check_is_tpu=True, check_is_gpu=True)


def test_is_peft_model_is_false_without_peft_or_for_a_plain_model():
    from accelerate.utils import is_peft_model as theirs

    from nbaccel.utils import is_peft_model

    model = torch.nn.Linear(1, 1)
    assert is_peft_model(model) is False and bool(theirs(model)) is False
