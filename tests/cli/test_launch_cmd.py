"""`nbaccel launch`: real scripts on 2 CPU processes, flags over the file, failures, signals, errors."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import yaml

from nbaccel.config import LaunchConfig, save_config
from tests.cli.helpers import (
    Running,
    env_with,
    nbaccel,
    processes_in_group,
    write_script,
)
from tests.cli.test_env_cmd import ACCELERATE_YAML

REPORT = """\
import sys
import torch
import torch.distributed as dist
from nbaccel.environment import read_worker_settings

dist.init_process_group("gloo")
total = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(total)
mp = read_worker_settings().mixed_precision
print(f"name={__name__} rank={dist.get_rank()} world={dist.get_world_size()} sum={total.item():g} mp={mp} "
      f"argv={sys.argv[1:]}", flush=True)
dist.destroy_process_group()
"""

TRAIN = """\
import torch
from torch.utils.data import DataLoader, TensorDataset
from nbaccel import Accelerator

accelerator = Accelerator()
torch.manual_seed(0)
x = torch.randn(64, 4)
y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
losses = []
for epoch in range(3):
    for xb, yb in loader:
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.gather(loss.detach()).mean().item())
print(f"rank={accelerator.process_index} world={accelerator.num_processes} mp={accelerator.mixed_precision} "
      f"steps={len(losses)}", flush=True)
if accelerator.is_main_process:
    print(f"first_loss={losses[0]:.4f} final_loss={losses[-1]:.4f}", flush=True)
"""

FAILING = """\
import os, sys
rank = int(os.environ["RANK"])
how = sys.argv[1]
if rank == 1:
    if how == "raise":
        def inner():
            raise ValueError("boom on rank 1")
        inner()
    if how == "exit":
        sys.exit(3)
    if how == "os_exit":
        os._exit(7)
print("rank", rank, "done", flush=True)
"""

SLEEPER = """\
import os, time
print("ready", os.environ["RANK"], flush=True)
time.sleep(60)
"""


def _script(tmp_path: Path, body: str, name: str = "train.py") -> str:
    return str(write_script(tmp_path / name, body))


def test_launch_runs_the_script_on_two_labelled_processes_with_its_args(tmp_path):
    script = _script(tmp_path, REPORT)
    result = nbaccel("launch", "--num_processes", "2", script, "--lr", "0.1", "--num_processes", "9")
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert (f"[rank{rank}]: name=__main__ rank={rank} world=2 sum=3 mp=no "
                f"argv=['--lr', '0.1', '--num_processes', '9']") in result.stdout


def test_an_accelerator_script_trains_under_launch_with_its_flags(tmp_path):
    result = nbaccel("launch", "--num_processes", "2", "--mixed_precision", "bf16", _script(tmp_path, TRAIN))
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):  # 64 samples, 8 per batch, 2 ranks: 4 steps an epoch
        assert f"[rank{rank}]: rank={rank} world=2 mp=bf16 steps=12" in result.stdout
    losses = [line for line in result.stdout.splitlines() if "final_loss=" in line]
    assert len(losses) == 1 and losses[0].startswith("[rank0]: "), result.stdout
    first, final = (float(part.split("=")[1]) for part in losses[0].split(": ", 1)[1].split())
    assert final < 0.5 * first


def test_flags_override_the_config_file(tmp_path):
    save_config(LaunchConfig(num_processes=1, mixed_precision="fp16", use_cpu=True), os.environ["NBACCEL_CONFIG_FILE"])
    script = _script(tmp_path, REPORT)
    from_file = nbaccel("launch", script)
    assert "[rank0]: name=__main__ rank=0 world=1 sum=1 mp=fp16" in from_file.stdout, from_file.stderr
    flagged = nbaccel("launch", "--num-processes", "2", "--mixed_precision", "bf16", script)
    assert flagged.returncode == 0, flagged.stderr
    assert "[rank1]: name=__main__ rank=1 world=2 sum=3 mp=bf16" in flagged.stdout


def test_an_accelerate_config_file_loads_with_config_file(tmp_path):
    path = tmp_path / "default_config.yaml"
    path.write_text(ACCELERATE_YAML)
    result = nbaccel("launch", "--config_file", str(path), _script(tmp_path, REPORT))
    assert result.returncode == 0, result.stderr
    assert "[rank1]: name=__main__ rank=1 world=2 sum=3 mp=bf16" in result.stdout


def test_spawn_and_module_mode(tmp_path):
    _script(tmp_path, REPORT, "report_mod.py")
    result = nbaccel("launch", "--num_processes", "2", "--start_method", "spawn", "-m", "report_mod", "x",
                     env=env_with(PYTHONPATH=str(tmp_path)), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "[rank1]: name=__main__ rank=1 world=2 sum=3 mp=no argv=['x']" in result.stdout


def test_a_failing_rank_gives_a_non_zero_exit_and_its_traceback(tmp_path):
    script = _script(tmp_path, FAILING)
    result = nbaccel("launch", "--num_processes", "2", script, "raise")
    assert result.returncode == 1
    err = result.stderr
    assert "nbaccel launch: traceback of rank 1 (the root cause):\nTraceback (most recent call last):" in err
    assert f'File "{script}", line 7, in inner' in err and "ValueError: boom on rank 1" in err
    assert "runpy" not in err and "nbaccel/launch" not in err  # the launcher's own frames are trimmed
    assert "nbaccel launch: error: root cause: rank 1" in err


@pytest.mark.parametrize(("how", "code"), [("exit", 3), ("os_exit", 7)])
def test_the_failing_ranks_exit_code_becomes_the_launchers(tmp_path, how, code):
    result = nbaccel("launch", "--num_processes", "2", _script(tmp_path, FAILING), how)
    assert result.returncode == code, result.stderr
    assert "root cause: rank 1" in result.stderr and "Traceback" not in result.stderr


def test_sigint_to_the_process_group_exits_130_and_leaves_nothing(tmp_path):
    run = Running("launch", "--num_processes", "2", _script(tmp_path, SLEEPER))
    run.wait_for("[rank0]: ready 0", "[rank1]: ready 1")
    os.killpg(run.proc.pid, signal.SIGINT)
    code, err = run.finish()
    assert code == 130, err
    assert "nbaccel launch: interrupted; every worker was stopped" in err
    deadline = time.monotonic() + 5
    while processes_in_group(run.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_in_group(run.proc.pid) == []


def test_sigterm_to_the_launcher_stops_the_workers(tmp_path):
    run = Running("launch", "--num_processes", "2", _script(tmp_path, SLEEPER))
    run.wait_for("[rank0]: ready 0", "[rank1]: ready 1")
    os.kill(run.proc.pid, signal.SIGTERM)
    code, err = run.finish()
    assert code == 128 + signal.SIGTERM, err
    assert "received SIGTERM; every worker was stopped" in err
    assert processes_in_group(run.proc.pid) == []


# ----------------------------------------------------------------------------- SLURM


def _slurm(**extra: str) -> dict[str, str]:
    return env_with(**{"SLURM_JOB_ID": "123456", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
                       "SLURM_JOB_NODELIST": "node[03-04]", **extra})


def test_slurm_variables_place_this_machine_and_flags_still_win(tmp_path):
    script = _script(tmp_path, REPORT)
    result = nbaccel("launch", "--dry_run", script, env=_slurm())
    assert result.returncode == 0, result.stderr
    cfg = yaml.safe_load(result.stdout.split("\n", 1)[1])
    assert (cfg["num_machines"], cfg["machine_rank"], cfg["main_process_ip"], cfg["main_process_port"]) == \
        (2, 1, "node03", 15000 + 3456)
    assert "nbaccel: SLURM job 123456: this is machine 1 of 2; machine 0 is node03" in result.stderr
    flagged = nbaccel("launch", "--dry_run", "--main_process_port", "29999", "--machine_rank", "0", script,
                      env=_slurm())
    cfg = yaml.safe_load(flagged.stdout.split("\n", 1)[1])
    assert (cfg["main_process_port"], cfg["machine_rank"]) == (29999, 0)


@pytest.mark.parametrize(("extra", "message"), [
    ({"SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_NUM_NODES": "2"}, "srun --ntasks-per-node=1 nbaccel launch"),
    ({"SLURM_JOB_NODELIST": "node[03-04"}, "is not a host list"),
    ({"SLURM_NNODES": "two"}, "SLURM variable SLURM_NNODES must be a number"),
])
def test_unusable_slurm_variables_are_one_clear_error(tmp_path, extra, message):
    result = nbaccel("launch", "--dry_run", _script(tmp_path, REPORT), env=_slurm(**extra))
    assert result.returncode == 2
    assert result.stderr.startswith("nbaccel launch: error: ") and message in result.stderr
    assert "Traceback" not in result.stderr


def test_two_launchers_form_one_job_from_slurm_variables(tmp_path):
    """Two machines on loopback, each told its place only by SLURM (torch elastic underneath)."""
    script = _script(tmp_path, REPORT)
    env = {rank: env_with(SLURM_JOB_ID=str(40000 + os.getpid() % 9000), SLURM_NNODES="2", SLURM_NODEID=str(rank),
                          SLURM_JOB_NODELIST="127.0.0.1,127.0.0.1") for rank in (0, 1)}
    runs = [Running("launch", "--num_processes", "1", script, "multi", env=env[rank]) for rank in (0, 1)]
    runs[0].wait_for("[rank0]: name=__main__ rank=0 world=2 sum=3 mp=no argv=['multi']")
    runs[1].wait_for("[rank1]: name=__main__ rank=1 world=2 sum=3 mp=no argv=['multi']")
    assert [r.finish(timeout=60)[0] for r in runs] == [0, 0]


# ----------------------------------------------------------------------------- mistakes


@pytest.mark.parametrize(("args", "message"), [
    (["launch"], "the following arguments are required: script"),
    (["launch", "--num_processes", "two", "s.py"],
     "argument --num_processes/--num-processes: invalid int value: 'two'"),
    (["launch", "--mixed_precision", "fp9", "s.py"],
     "argument --mixed_precision/--mixed-precision: invalid choice: 'fp9'"),
    (["launch", "--num_processes", "0", "{script}"], "--num_processes 0: 'num_processes' must be a positive int"),
    (["launch", "--num_machines", "2", "{script}"], "'main_process_ip' is required when num_machines=2"),
    (["launch", "--num_machines", "2", "--machine_rank", "3", "--main_process_ip", "h", "{script}"],
     "--machine_rank 3: 'machine_rank' must be in [0, 1]"),
    (["launch", "--main_process_port", "70000", "{script}"], "'main_process_port' must be in 1..65535"),
    (["launch", "--hang_timeout", "0", "{script}"], "--hang_timeout must be a positive number"),
    (["launch", "missing.py"], "script 'missing.py' does not exist"),
    (["launch", "{dir}"], "is a directory, not a script"),
    (["launch", "-m", "no_such_module_xyz"], "module 'no_such_module_xyz' cannot be found"),
    (["launch", "--config_file", "{dir}/none.yaml", "{script}"], "none.yaml' does not exist"),
    (["launch", "--gpu_ids", "zero", "{script}"], "'gpu_ids' must be 'all' or comma-separated GPU numbers or UUIDs"),
    (["launch", "--config_file", "{bad_yaml}", "{script}"], "is not valid YAML"),
    (["launch", "--config_file", "{unknown_key}", "{script}"], "unknown key 'num_gpus'"),
    (["launch", "--config_file", "{bad_value}", "{script}"], "'mixed_precision' must be one of"),
    (["test", "--num_processes", "-1"], "--num_processes -1: 'num_processes' must be a positive int"),
])
def test_mistakes_are_one_message_and_a_non_zero_exit(tmp_path, args, message):
    files = {"script": _script(tmp_path, REPORT), "dir": str(tmp_path)}
    for name, text in (("bad_yaml", "num_processes: [2\n"), ("unknown_key", "num_gpus: 2\n"),
                       ("bad_value", "mixed_precision: fp9\n")):
        files[name] = str(write_script(tmp_path / f"{name}.yaml", text))
    result = nbaccel(*[a.format(**files) for a in args], cwd=tmp_path)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert message in result.stderr
    assert result.stderr.startswith(f"nbaccel {args[0]}: error: ")
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_a_launch_that_cannot_start_is_one_line_and_exit_1(tmp_path):
    result = nbaccel("launch", "--num_processes", "2", "--start_method", "fork", _script(tmp_path, REPORT),
                     env=env_with(NBACCEL_ASSUME_UNSAFE_FORK="1"))
    assert result.returncode == 1
    assert result.stderr.startswith("nbaccel launch: error: start_method='fork' is unsafe here")
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_when_fork_is_unsafe_the_launch_spawns_and_says_why(tmp_path):
    result = nbaccel("launch", "--num_processes", "2", _script(tmp_path, REPORT),
                     env=env_with(NBACCEL_ASSUME_UNSAFE_FORK="1"))
    assert result.returncode == 0, result.stderr
    assert "starting workers with spawn, not fork" in result.stderr
    assert "[rank1]: name=__main__ rank=1 world=2 sum=3" in result.stdout
