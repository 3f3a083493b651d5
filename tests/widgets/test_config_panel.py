"""The configuration panel in-process: every field, validation as you type, Save, session."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from nbaccel.config import LaunchConfig, load_config, save_config
from nbaccel.environment import config_file_path
from nbaccel.errors import ConfigError, MissingDependencyError
from nbaccel.widgets.config_panel import ConfigPanel, FieldSpec, field_specs


def _panel(**kwargs) -> ConfigPanel:
    panel = ConfigPanel(load_config(), path=str(config_file_path()), **kwargs)
    panel.widget()
    return panel


def test_every_config_field_has_an_editor():
    panel = _panel()
    assert set(panel._editors) == {f.name for f in dataclasses.fields(LaunchConfig)}
    assert panel._editors["mixed_precision"].options == ("no", "fp16", "bf16", "fp8")
    assert panel._editors["start_method"].options == ("auto", "fork", "spawn")
    assert panel._editors["start_method"].value == "auto" and panel.config.start_method is None
    panel._editors["start_method"].value = "spawn"
    assert panel.config.start_method == "spawn"
    panel._editors["start_method"].value = "auto"
    assert panel.config.start_method is None
    assert "detected:" in panel._box.children[0].value and "CPU" in panel._box.children[0].value


def test_typing_an_invalid_value_is_flagged_at_once_and_blocks_save():
    panel = _panel()
    panel._editors["num_processes"].value = "four"
    assert panel.error is not None and panel.error.key == "num_processes"
    assert "'num_processes' must be a whole number or empty for auto (got 'four')" in panel._message.value
    assert panel._save.disabled and panel._use.disabled
    assert "nbaccel-invalid" in panel._editors["num_processes"]._dom_classes
    panel._editors["num_processes"].value = "0"
    assert "'num_processes' must be a positive int (got 0)" in panel._message.value
    panel._editors["num_processes"].value = "3"
    assert panel.error is None and not panel._save.disabled and panel._message.value == ""
    assert "nbaccel-invalid" not in panel._editors["num_processes"]._dom_classes


def test_impossible_combinations_are_flagged_on_the_field_at_fault():
    panel = _panel()
    panel._editors["num_machines"].value = "2"
    assert panel.error.key == "main_process_ip" and "required when num_machines=2" in panel._message.value


def test_save_writes_the_same_yaml_as_save_config(tmp_path):
    panel = _panel()
    panel._editors["num_processes"].value = "3"
    panel._editors["mixed_precision"].value = "bf16"
    panel._editors["fsdp_config"].value = "{fsdp_sharding_strategy: FULL_SHARD}"
    panel._save.click()
    assert "Saved to" in panel._message.value
    written = load_config()
    assert (written.num_processes, written.mixed_precision) == (3, "bf16")
    assert written.fsdp_config == {"fsdp_sharding_strategy": "FULL_SHARD"}
    reference = save_config(written, tmp_path / "reference.yaml")
    assert config_file_path().read_text() == reference.read_text()


def test_save_and_use_refuse_invalid_values():
    panel = _panel()
    panel._editors["timeout"].value = "-5"
    with pytest.raises(ConfigError, match="'timeout' must be a positive number"):
        panel.save()
    with pytest.raises(ConfigError, match="'timeout' must be a positive number"):
        panel.use_for_session()
    assert not config_file_path().exists()
    panel._click(panel.save)  # the button path reports instead of raising
    assert "Not done" in panel._message.value


def test_use_for_session_hands_over_only_what_differs_from_the_file():
    save_config(LaunchConfig(num_processes=2))
    received = []
    panel = _panel(on_use=received.append)
    panel._editors["mixed_precision"].value = "fp16"
    panel._use.click()
    assert received == [{"mixed_precision": "fp16"}]
    assert "mixed_precision='fp16'" in panel._message.value


def test_text_form_lists_values_and_points_to_the_cli():
    text = ConfigPanel(LaunchConfig(num_processes=4, timeout=30.0), path="/x.yaml").text()
    assert "num_processes: 4" in text and "timeout: 30" in text and "start_method: auto" in text
    assert "main_process_ip: none" in text and "fsdp_config: {}" in text and "nbaccel config" in text


def test_field_spec_parsing():
    specs = {s.name: s for s in field_specs()}
    assert specs["timeout"].parse("2.5") == 2.5 and specs["timeout"].parse("") is None
    assert specs["gpu_ids"].parse(" 0,1 ") == "0,1"
    with pytest.raises(ConfigError, match="must be a YAML mapping"):
        specs["fsdp_config"].parse("[1, 2]")
    with pytest.raises(ConfigError, match="must be a number"):
        FieldSpec("timeout", "float", True).parse("soon")


def test_the_distributed_type_choices_are_the_kinds_a_launch_takes():
    from nbaccel.distributed_type import LAUNCHABLE_TYPES

    specs = {s.name: s for s in field_specs()}
    assert specs["distributed_type"].choices == ("NO", "MULTI_CPU", "MULTI_GPU", "XLA", "FSDP", "DEEPSPEED")
    assert specs["distributed_type"].choices == tuple(t.value for t in LAUNCHABLE_TYPES)
    pytest.importorskip("ipywidgets")
    panel = ConfigPanel(LaunchConfig(), path="/x.yaml")
    panel.widget()
    shown = panel._editors["distributed_type"].options
    assert "MULTI_NPU" not in shown and "MEGATRON_LM" not in shown and "MULTI_CPU" in shown


def test_without_ipywidgets_the_panel_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ipywidgets", None)
    panel = ConfigPanel(LaunchConfig(), path="/x.yaml")
    with pytest.raises(MissingDependencyError, match="pip install ipywidgets"):
        panel.widget()
    assert "num_processes: auto" in repr(panel)
