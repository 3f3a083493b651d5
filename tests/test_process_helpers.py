"""Accelerator's process helpers: decorators that need a rank, and splitting inputs between processes."""

from __future__ import annotations

import pytest

from nbaccel import Accelerator, ConfigError, notebook_launcher


@pytest.mark.parametrize(("decorator", "key"), [("on_process", "process_index"),
                                                ("on_local_process", "local_process_index")])
def test_rank_decorators_without_a_rank_name_the_missing_argument(decorator, key):
    accelerator = Accelerator(cpu=True)
    with pytest.raises(ConfigError) as info:
        getattr(accelerator, decorator)(lambda: None)
    assert info.value.key == key and f"{key}=0" in str(info.value)


def _split_ragged_dict() -> str:
    accelerator = Accelerator()
    try:
        with accelerator.split_between_processes({"x": [1, 2, 3], "y": [4, 5]}):
            return "split"
    except ConfigError as exc:
        return f"{exc.key}: {exc.value}"


def test_splitting_a_dict_of_unequal_lengths_is_refused_on_every_rank():
    got = notebook_launcher(_split_ragged_dict, num_processes=2, return_all=True)
    assert got == {0: "inputs: {'x': 3, 'y': 2}", 1: "inputs: {'x': 3, 'y': 2}"}
