"""The package surface: exported names, typing marker, and a light import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbaccel


def test_all_is_sorted_and_every_name_resolves():
    assert nbaccel.__all__ == sorted(nbaccel.__all__)
    for name in nbaccel.__all__:
        assert getattr(nbaccel, name) is not None, name


def test_accelerate_names_are_exported_at_the_top_level():
    names = {"AcceleratorState", "DistributedType", "PartialState", "find_executable_batch_size",
             "synchronize_rng_states"}
    assert names <= set(nbaccel.__all__)
    assert issubclass(nbaccel.AcceleratorState, nbaccel.PartialState)
    assert issubclass(nbaccel.PartialState, nbaccel.ProcessState)
    assert not hasattr(nbaccel, "utils")


def test_unknown_attribute_is_an_attribute_error():
    try:
        nbaccel.not_a_name  # noqa: B018
    except AttributeError as exc:
        assert "not_a_name" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_import_does_not_pull_ipython_or_widgets():
    code = "import sys, nbaccel; print('IPython' in sys.modules, 'ipywidgets' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_py_typed_ships():
    assert (Path(nbaccel.__file__).parent / "py.typed").exists()
