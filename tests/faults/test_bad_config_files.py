"""Fault matrix, config rows: a bad config file is a clear ConfigError everywhere, an Accelerate file works.

A file that is not UTF-8 and one whose ``extra`` is not a mapping are reported in one line, with no
traceback, by ``nbaccel env``, ``nbaccel launch`` and ``%%accel_launch``, and nothing starts.
Every key Accelerate 1.16's config files can hold loads, and the ones nbaccel does not act on are
listed in one line.
"""

from __future__ import annotations

import dataclasses

import pytest
from IPython.core.error import UsageError

import nbaccel
from nbaccel.config import LaunchConfig, load_config
from tests.cli.helpers import nbaccel as run_nbaccel
from tests.magics.conftest import ip, run  # noqa: F401 - the in-process shell fixture

BAD_FILES = {
    "not-utf8": (b'num_processes: 2\nmixed_precision: "\xff\xfe"\n', "is not UTF-8 text (byte 0xff at offset 35)"),
    "extra-5": (b"num_processes: 2\nextra: 5\n", "'extra' must be a mapping of Accelerate keys to values (got 5"),
}

# Every field of Accelerate 1.16's config dataclasses (commands/config/config_args.py: BaseConfig,
# ClusterConfig, SageMakerConfig), with a value of the type Accelerate writes.
ACCELERATE_1_16_FILE = {
    "compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_CPU", "mixed_precision": "no",
    "use_cpu": True, "debug": False, "num_processes": 2, "machine_rank": 0, "num_machines": 1, "gpu_ids": "all",
    "main_process_ip": None, "main_process_port": None, "rdzv_backend": "static", "same_network": True,
    "main_training_function": "main", "enable_cpu_affinity": False, "fp8_config": {}, "deepspeed_config": {},
    "fsdp_config": {}, "parallelism_config": {}, "megatron_lm_config": {}, "mpirun_config": {},
    "downcast_bf16": False, "tpu_name": None, "tpu_zone": None, "tpu_use_cluster": False, "tpu_use_sudo": False,
    "command_file": None, "commands": None, "tpu_vm": None, "tpu_env": [], "dynamo_config": {},
    "ec2_instance_type": "ml.p3.2xlarge", "iam_role_name": "role", "image_uri": None, "profile": None,
    "region": "us-east-1", "base_job_name": "accelerate-sagemaker-1", "pytorch_version": "2.1.0",
    "transformers_version": "4.31.0", "py_version": "py310", "sagemaker_inputs_file": None,
    "sagemaker_metrics_file": None, "additional_args": None,
}


@pytest.fixture(params=sorted(BAD_FILES))
def bad_file(request, tmp_path):
    content, message = BAD_FILES[request.param]
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    return path, message


def test_load_config_raises_a_config_error_naming_the_file(bad_file):
    path, message = bad_file
    with pytest.raises(nbaccel.ConfigError) as info:
        load_config(path)
    assert message in str(info.value) and "Fix:" in str(info.value)


def test_nbaccel_env_reports_the_bad_file_in_its_report(bad_file):
    path, message = bad_file
    done = run_nbaccel("env", "--config_file", str(path))
    assert done.returncode == 0 and "Traceback" not in done.stdout + done.stderr
    assert "- Config in effect: INVALID: " in done.stdout and message in done.stdout


def test_nbaccel_launch_refuses_the_bad_file_in_one_line_and_runs_nothing(bad_file, tmp_path):
    path, message = bad_file
    script = tmp_path / "train.py"
    script.write_text("open(__file__ + '.ran', 'w')\n")
    done = run_nbaccel("launch", "--config_file", str(path), str(script))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "train.py.ran").exists()


def test_accel_launch_refuses_the_bad_file_as_a_usage_error(ip, bad_file, capfd):  # noqa: F811 - `ip` is the imported fixture
    path, message = bad_file
    result = run(ip, f"%%accel_launch --config_file {path}\nprint('ran')\n")
    assert isinstance(result.error_in_exec, UsageError) and message in str(result.error_in_exec)
    assert "ran" not in capfd.readouterr().out


def test_the_key_list_is_accelerate_1_16s():
    config_args = pytest.importorskip("accelerate.commands.config.config_args")
    fields = set()
    for cls in (config_args.BaseConfig, config_args.ClusterConfig, config_args.SageMakerConfig):
        fields |= {f.name for f in dataclasses.fields(cls)}
    assert fields == set(ACCELERATE_1_16_FILE)


def test_every_accelerate_key_loads_and_the_unused_are_listed_in_one_line(tmp_path):
    import yaml

    path = tmp_path / "default_config.yaml"
    path.write_text(yaml.safe_dump({**ACCELERATE_1_16_FILE, "tp_config": {}, "dynamo_backend": "NO", "fp16": False}))
    cfg = load_config(path)
    assert cfg.num_processes == 2 and cfg.use_cpu
    used = {f.name for f in dataclasses.fields(LaunchConfig)}
    assert set(cfg.unused_keys) == set(ACCELERATE_1_16_FILE) - used | {"tp_config", "dynamo_backend", "fp16"}
    assert load_config(path).to_mapping().keys() >= ACCELERATE_1_16_FILE.keys()  # kept for a save
    done = run_nbaccel("env", "--config_file", str(path))
    lines = [line for line in done.stdout.splitlines() if "kept but not used" in line]
    assert len(lines) == 1 and "tpu_vm" in lines[0] and "iam_role_name" in lines[0]
