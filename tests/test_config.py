"""LaunchConfig: validation, the config file, Accelerate's keys, and precedence."""

from __future__ import annotations

import json

import pytest

from nbaccel import ConfigError, LaunchConfig, load_config, save_config
from nbaccel.environment import config_file_path

ACCELERATE_FILE = """
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_GPU
downcast_bf16: 'no'
enable_cpu_affinity: false
gpu_ids: all
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


def test_an_accelerate_config_file_loads_unchanged(tmp_path):
    path = tmp_path / "default_config.yaml"
    path.write_text(ACCELERATE_FILE)
    cfg = load_config(path)
    assert (cfg.distributed_type, cfg.num_processes, cfg.mixed_precision) == ("MULTI_GPU", 2, "bf16")
    assert cfg.extra["compute_environment"] == "LOCAL_MACHINE"
    save_config(cfg, tmp_path / "again.yaml")
    assert load_config(tmp_path / "again.yaml") == cfg


def test_accelerate_num_processes_counts_all_machines(tmp_path):
    path = tmp_path / "multi.yaml"
    path.write_text("num_machines: 2\nnum_processes: 8\nmain_process_ip: 10.0.0.1\nmachine_rank: 1\n")
    cfg = load_config(path)
    assert cfg.num_processes == 4
    assert cfg.to_mapping()["num_processes"] == 8


def test_tpu_is_accelerates_old_name_for_xla():
    assert LaunchConfig.from_mapping({"distributed_type": "TPU"}).distributed_type == "XLA"


def test_default_path_honours_env_and_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("NBACCEL_CONFIG_FILE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert config_file_path() == tmp_path / "nbaccel" / "default_config.yaml"
    monkeypatch.setenv("NBACCEL_CONFIG_FILE", str(tmp_path / "x.yaml"))
    assert config_file_path() == tmp_path / "x.yaml"


def test_save_and_load_default_location_and_json(tmp_path):
    written = save_config(LaunchConfig(num_processes=3, mixed_precision="fp16"))
    assert written == config_file_path()
    assert load_config().num_processes == 3
    json_path = save_config(LaunchConfig(num_processes=2), tmp_path / "c.json")
    assert json.loads(json_path.read_text())["num_processes"] == 2
    assert load_config(json_path).num_processes == 2


def test_missing_default_file_gives_defaults_but_named_missing_file_is_an_error(tmp_path):
    assert load_config() == LaunchConfig()
    with pytest.raises(ConfigError, match="does not exist") as info:
        load_config(tmp_path / "nope.yaml")
    assert info.value.key == "config_file"


@pytest.mark.parametrize("text, key", [
    ("num_processes: two\n", "num_processes"),
    ("mixed_precision: fp32\n", "mixed_precision"),
    ("use_cpu: 'yes'\n", "use_cpu"),
    ("learning_rate: 3\n", "learning_rate"),
    ("num_processes: 0\n", "num_processes"),
    ("num_machines: 2\n", "main_process_ip"),
    ("machine_rank: 3\nnum_machines: 2\nmain_process_ip: h\n", "machine_rank"),
    ("distributed_type: MULTI_NPU\n", "distributed_type"),
    ("use_cpu: true\ndistributed_type: MULTI_GPU\n", "distributed_type"),
    ("gpu_ids: zero\n", "gpu_ids"),
    ("main_process_port: 70000\n", "main_process_port"),
    ("timeout: -1\n", "timeout"),
    ("num_machines: 0\n", "num_machines"),
    ("fsdp_config: 3\n", "fsdp_config"),
    ("main_process_ip: 5\n", "main_process_ip"),
    ("timeout: fast\n", "timeout"),
])
def test_bad_values_name_the_key_value_and_valid_values(tmp_path, text, key):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == key
    assert str(path) in str(info.value)
    assert info.value.valid is not None


def test_not_a_mapping_and_broken_yaml_are_errors(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(path)
    path.write_text("num_processes: [1\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(bad_json)


def test_precedence_layers_apply_in_order():
    file_cfg = LaunchConfig(num_processes=2, mixed_precision="fp16", timeout=10.0)
    session = file_cfg.with_overrides(mixed_precision="bf16")
    flags = session.with_overrides(num_processes=4, timeout=None)
    assert (flags.num_processes, flags.mixed_precision, flags.timeout) == (4, "bf16", 10.0)
    with pytest.raises(ConfigError) as info:
        flags.with_overrides(n_procs=3)
    assert info.value.key == "n_procs"


def test_error_message_lists_valid_values_from_the_type():
    with pytest.raises(ConfigError) as info:
        LaunchConfig(start_method="forkserver")
    assert "['fork', 'spawn']" in str(info.value)


def test_a_value_matching_no_member_of_a_union_names_every_member():
    from nbaccel.config import _check_type

    _check_type("port_or_name", "db", int | str)  # either member will do
    with pytest.raises(ConfigError) as info:
        _check_type("port_or_name", 1.5, int | str)
    assert info.value.key == "port_or_name" and info.value.value == 1.5
    assert "'port_or_name' must be one of ['int', 'str'] (got 1.5)" in str(info.value)
