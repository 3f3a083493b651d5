"""The checks code relies on, through Accelerate and nbaccel: what raises (and as what), what only logs or warns.

Loading with unexpected keys, shape checks when setting a tensor, device maps naming unknown modules
(one process); ``split_batches`` with a batch size the processes do not divide (two processes).
"""

from __future__ import annotations

import importlib
import json
import logging
import warnings
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch.utils.data import DataLoader

from tests.training.helpers import launch

pytest.importorskip("accelerate")

LIBRARIES = ["accelerate", "nbaccel"]


def utils(library: str):
    return importlib.import_module(f"{library}.utils")


def loaded_with_extra_keys(library: str, path: Path, caplog: pytest.LogCaptureFixture) -> dict:
    torch.manual_seed(1)
    model = torch.nn.Linear(2, 2)
    caplog.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a logged message, never a warning
        utils(library).load_checkpoint_in_model(model, str(path))
    logged = [r for r in caplog.records if "extra" in r.getMessage()]
    try:
        utils(library).load_checkpoint_in_model(torch.nn.Linear(2, 2), str(path), strict=True)
        strict = "loaded"
    except RuntimeError:
        strict = "RuntimeError"
    return {"weight": model.weight.tolist(), "logged": [(r.levelno, "were not used when" in r.getMessage())
                                                         for r in logged], "strict": strict}


def test_unexpected_checkpoint_keys_are_logged_and_loading_goes_on(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    source = torch.nn.Linear(2, 2)
    path = tmp_path / "model.safetensors"
    state = {k: v.detach().clone() for k, v in source.state_dict().items()}
    safetensors.torch.save_file({**state, "extra": torch.ones(3)}, str(path), metadata={"format": "pt"})
    theirs, ours = (loaded_with_extra_keys(lib, path, caplog) for lib in LIBRARIES)
    assert ours == theirs == {"weight": source.weight.tolist(), "logged": [(logging.WARNING, True)],
                              "strict": "RuntimeError"}


def set_tensor(library: str, value: torch.Tensor) -> str:
    model = torch.nn.Linear(2, 3)
    try:
        utils(library).set_module_tensor_to_device(model, "weight", "cpu", value=value)
    except ValueError as exc:  # Accelerate's own test checks these words
        return f"ValueError: {str(exc).split(' Fix:')[0]}"
    return f"set {tuple(model.weight.shape)}"


@pytest.mark.parametrize("shape,expected", [((3, 2), "set (3, 2)"),
                                            ((4, 2), 'ValueError: Trying to set a tensor of shape torch.Size([4, 2]) '
                                                     'in "weight" (which has shape torch.Size([3, 2])), this looks '
                                                     'incorrect.')])
def test_set_module_tensor_to_device_checks_the_shape(shape, expected):
    assert [set_tensor(lib, torch.ones(shape)) for lib in LIBRARIES] == [expected, expected]


def checked_map(library: str) -> dict:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        utils(library).check_device_map(model, {"": "cpu", "9": "cpu"})
    try:
        utils(library).check_device_map(model, {"0": "cpu"})
        uncovered = "passed"
    except ValueError:
        uncovered = "ValueError"
    return {"warned": [(w.category, "'9'" in str(w.message)) for w in caught], "uncovered": uncovered}


def test_check_device_map_warns_on_unknown_keys_and_fails_on_uncovered_tensors():
    theirs, ours = (checked_map(lib) for lib in LIBRARIES)
    assert ours == theirs == {"warned": [(UserWarning, True)], "uncovered": "ValueError"}


def split_unevenly(library: str, batch_size: int) -> str:
    lib = importlib.import_module(library)
    if library == "accelerate":  # its process-wide singletons survive fork
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    config = lib.DataLoaderConfiguration(split_batches=True)
    accelerator = lib.Accelerator(cpu=True, dataloader_config=config)
    try:
        loader = accelerator.prepare(DataLoader(list(range(12)), batch_size=batch_size))
    except ValueError as exc:  # nbaccel's is a ConfigError with the value on it
        return f"ValueError {getattr(exc, 'value', batch_size)}"
    return f"batches {[b.tolist() for b in loader]}"


@pytest.mark.parametrize("batch_size", [3, 4])
def test_split_batches_needs_a_batch_size_the_processes_divide(batch_size):
    theirs, ours = (launch(split_unevenly, 2, lib, batch_size) for lib in LIBRARIES)
    assert ours == theirs
    if batch_size == 3:
        assert ours == {0: "ValueError 3", 1: "ValueError 3"}
    else:
        assert ours[0] == "batches [[0, 1], [4, 5], [8, 9]]"


def test_recursively_apply_on_another_type_says_what_accelerate_says():
    messages = []
    for library in LIBRARIES:
        with pytest.raises(TypeError) as info:
            utils(library).recursively_apply(torch.neg, (torch.tensor(1), 1), error_on_other_type=True)
        messages.append(str(info.value))
    assert messages[0] == messages[1] == ("Unsupported types (<class 'int'>) passed to `neg`. Only nested "
                                          "list/tuple/dicts of objects that are valid for `is_torch_tensor` should be "
                                          "passed.")


def uncovered_message(library: str) -> str:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 5))
    with pytest.raises(ValueError) as info:
        utils(library).check_device_map(model, {"0": "cpu", "2": "cpu"})
    return str(info.value).split(". Fix:")[0]


def test_check_device_map_names_the_uncovered_tensors_as_accelerate_does():
    assert uncovered_message("nbaccel") == uncovered_message("accelerate") == (
        "The device_map provided does not give any device for the following parameters: 1.weight, 1.bias, "
        "1.running_mean, 1.running_var, 1.num_batches_tracked")


def loaded_from_a_bare_index(library: str, folder: Path) -> list:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 5))
    utils(library).load_checkpoint_in_model(model, str(folder))
    return [p.tolist() for p in model.parameters()]


def test_a_sharded_checkpoint_with_a_bare_index_of_any_name_loads(tmp_path):
    """Accelerate's own test writes ``weight_map.index.json`` holding the name -> file mapping alone."""
    source = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 5))
    state = source.state_dict()
    index = {name: f"part{name.split('.')[0]}.bin" for name in state}
    (tmp_path / "weight_map.index.json").write_text(json.dumps(index))
    for part in ("0", "1"):
        torch.save({k: v for k, v in state.items() if k.startswith(part + ".")}, tmp_path / f"part{part}.bin")
    theirs, ours = (loaded_from_a_bare_index(lib, tmp_path) for lib in LIBRARIES)
    assert ours == theirs == [p.tolist() for p in source.parameters()]


def split_messages(library: str) -> list:
    data_loader = importlib.import_module(f"{library}.data_loader")
    messages = []
    for make in (lambda: data_loader.BatchSamplerShard(torch.utils.data.BatchSampler(range(9), 3, False), 2, 0,
                                                       split_batches=True),
                 lambda: data_loader.IterableDatasetShard(range(9), batch_size=3, num_processes=2, split_batches=True)):
        with pytest.raises(ValueError) as info:
            make()
        messages.append(str(info.value).split(" Fix:")[0])
    return messages


def test_split_batches_errors_say_what_accelerate_says():
    assert split_messages("nbaccel") == split_messages("accelerate") == [
        f"To use `{name}` in `split_batches` mode, the batch size (3) needs to be a round multiple of the number of "
        "processes (2)." for name in ("BatchSamplerShard", "IterableDatasetShard")]
