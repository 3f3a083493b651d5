"""Misuse of the tracking API is a clear error: what was wrong, what is valid, one fix."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import nbaccel
from nbaccel.tracking import GeneralTracker, LoggerType


def test_a_tracker_whose_library_is_missing_names_the_extra(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        sys.modules["mlflow"] = None  # as if mlflow were not installed
        import nbaccel
        try:
            nbaccel.Accelerator(log_with=["tensorboard", "mlflow"], project_dir={str(tmp_path)!r})
        except nbaccel.MissingDependencyError as exc:
            print("ERROR", exc.package, exc.install, "|", exc)
        accelerator = nbaccel.Accelerator(log_with="all", project_dir={str(tmp_path)!r})
        print("ALL", sorted(str(t) for t in accelerator.log_with))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    error = next(line for line in out.splitlines() if line.startswith("ERROR"))
    assert error.startswith("ERROR mlflow pip install 'nbaccel[mlflow]' |")
    assert "log_with='mlflow' needs the mlflow package" in error and "Fix: pip install 'nbaccel[mlflow]'" in error
    chosen = next(line for line in out.splitlines() if line.startswith("ALL"))
    assert "mlflow" not in chosen  # "all" quietly picks only what is installed


def test_unknown_tracker_names_list_the_valid_ones():
    with pytest.raises(nbaccel.ConfigError) as info:
        nbaccel.Accelerator(log_with="comet_ml")
    assert info.value.key == "log_with" and info.value.value == "comet_ml"
    assert list(info.value.valid) == LoggerType.list() and "GeneralTracker" in str(info.value)
    with pytest.raises(nbaccel.ConfigError):
        nbaccel.Accelerator(log_with=[3])


def test_tensorboard_needs_a_logging_directory():
    with pytest.raises(nbaccel.ConfigError) as info:
        nbaccel.Accelerator(log_with="tensorboard")
    assert info.value.key == "project_dir" and "project_dir='runs'" in str(info.value)


def test_a_tracker_class_instead_of_an_instance():
    class Mine(GeneralTracker):
        name, requires_logging_directory, tracker = "mine", False, None

    with pytest.raises(nbaccel.ConfigError) as info:
        nbaccel.Accelerator(log_with=Mine)
    assert "log_with=[Mine(...)]" in str(info.value)


def test_a_custom_tracker_missing_required_attributes():
    class Incomplete(GeneralTracker):
        pass

    with pytest.raises(NotImplementedError, match="`name`, `requires_logging_directory`, `tracker`"):
        Incomplete()


def test_bad_arguments_to_init_trackers_log_and_get_tracker(tmp_path):
    accelerator = nbaccel.Accelerator(log_with="tensorboard", project_dir=str(tmp_path))
    assert not hasattr(accelerator.get_tracker("tensorboard"), "name")  # a blank tracker before init_trackers
    with pytest.raises(nbaccel.ConfigError) as info:
        accelerator.init_trackers(7)  # type: ignore[arg-type]  # the wrong type is the test
    assert info.value.key == "project_name"
    with pytest.raises(nbaccel.ConfigError) as info:
        accelerator.init_trackers("run", init_kwargs="flush_secs=5")  # type: ignore[arg-type]  # the wrong type is the test
    assert info.value.key == "init_kwargs"
    with pytest.raises(nbaccel.ConfigError) as info:
        accelerator.init_trackers("run", init_kwargs={"tensorboard": 5})  # type: ignore[dict-item]  # the wrong type is the test
    assert info.value.key == "init_kwargs" and "init_kwargs={'tensorboard': {...}}" in str(info.value)
    accelerator.init_trackers("run")
    with pytest.raises(nbaccel.ConfigError) as info:
        accelerator.get_tracker("wandb")
    assert info.value.valid == ["tensorboard"]
    with pytest.raises(nbaccel.ConfigError) as info:
        accelerator.log([("loss", 1.0)])  # type: ignore[arg-type]  # the wrong type is the test
    assert info.value.key == "values"
    accelerator.end_training()
