"""`nbaccel env` and `env_report()`: versions, devices and the config in effect, for a bug report."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

import nbaccel
from nbaccel.hardware import cpu_count
from tests.cli.helpers import env_with
from tests.cli.helpers import nbaccel as run_nbaccel

ACCELERATE_YAML = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_CPU
downcast_bf16: 'no'
enable_cpu_affinity: false
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
use_cpu: true
"""


def test_env_reports_versions_devices_and_the_config_path():
    result = run_nbaccel("env")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("Copy-and-paste the text below in your GitHub issue.")
    assert f"- nbaccel version: {nbaccel.__version__}" in out
    assert f"- Python version: {platform.python_version()}" in out
    assert f"- PyTorch version: {torch.__version__}" in out
    assert f"- CPUs available to this process: {cpu_count()}" in out
    assert "- CUDA GPUs visible: " in out and "- TPU detected: " in out
    assert "- torch_xla version: " in out
    assert f"- Config file: {os.environ['NBACCEL_CONFIG_FILE']} (not written yet" in out
    assert "    num_processes: null" in out  # the defaults in effect


def test_env_shows_the_written_config():
    assert run_nbaccel("config", "--default", "--mixed_precision", "fp16").returncode == 0
    out = run_nbaccel("env").stdout
    assert f"- Config file: {os.environ['NBACCEL_CONFIG_FILE']}\n" in out
    assert "    mixed_precision: fp16" in out


def test_env_reads_an_accelerate_config_file(tmp_path):
    path = tmp_path / "default_config.yaml"
    path.write_text(ACCELERATE_YAML)
    out = run_nbaccel("env", "--config_file", str(path)).stdout
    assert f"- Config file: {path}\n" in out
    assert "    mixed_precision: bf16" in out and "    compute_environment: LOCAL_MACHINE" in out


def test_env_reports_an_invalid_config_instead_of_failing():
    Path(os.environ["NBACCEL_CONFIG_FILE"]).write_text("num_processes: lots\n")
    result = run_nbaccel("env")
    assert result.returncode == 0
    assert "- Config in effect: INVALID: " in result.stdout and "'num_processes' must be an int" in result.stdout


def test_env_lists_launch_related_variables():
    out = run_nbaccel("env", env=env_with(CUDA_VISIBLE_DEVICES="", SLURM_JOB_ID="77")).stdout
    assert "  - CUDA_VISIBLE_DEVICES=\n" in out and "  - SLURM_JOB_ID=77" in out


def test_env_with_a_missing_config_file_is_an_error(tmp_path):
    result = run_nbaccel("env", "--config_file", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2
    assert result.stderr.startswith("nbaccel env: error: --config_file") and "does not exist" in result.stderr
    assert "Traceback" not in result.stderr


def test_env_report_leaves_cuda_uninitialized():
    code = ("import torch, nbaccel.cli.env_cmd as e; text = e.env_report(); "
            "assert 'PyTorch version' in text; print(torch.cuda.is_initialized())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env_with(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_python_dash_m_nbaccel_runs_the_cli():
    out = subprocess.run([sys.executable, "-m", "nbaccel", "--version"], capture_output=True, text=True,
                         env=env_with(), timeout=60)
    assert (out.returncode, out.stdout.strip()) == (0, f"nbaccel {nbaccel.__version__}")


def test_usage_mistakes_are_one_line_and_exit_2():
    no_command = run_nbaccel()
    assert no_command.returncode == 2 and "config" in no_command.stderr and "Traceback" not in no_command.stderr
    unknown = run_nbaccel("deploy")
    assert unknown.returncode == 2
    assert unknown.stderr.startswith("nbaccel: error: argument {config,env,launch,test}: invalid choice: 'deploy'")
    assert len(unknown.stderr.strip().splitlines()) == 1
    helped = run_nbaccel("launch", "--help")
    assert helped.returncode == 0 and "--num_processes" in helped.stdout
