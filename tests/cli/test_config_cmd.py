"""`nbaccel config`: --default, questions on stdin, --config_file, and its error paths."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from nbaccel.config import LaunchConfig, load_config, save_config
from nbaccel.hardware import cpu_count, cuda_device_count
from tests.cli.helpers import nbaccel


def _config_path() -> Path:
    return Path(os.environ["NBACCEL_CONFIG_FILE"])


def test_default_writes_a_config_for_this_machine():
    result = nbaccel("config", "--default")
    assert result.returncode == 0, result.stderr
    cfg = load_config(_config_path())
    assert f"wrote {_config_path()}" in result.stdout
    assert cfg.num_machines == 1
    if cuda_device_count() == 0:
        assert cfg.use_cpu and cfg.num_processes == min(cpu_count(), 4)
        assert cfg.distributed_type == ("MULTI_CPU" if cfg.num_processes > 1 else "NO")


def test_default_with_config_file_and_mixed_precision_writes_only_there(tmp_path):
    target = tmp_path / "sub" / "mine.yaml"
    result = nbaccel("config", "--default", "--config_file", str(target), "--mixed_precision", "bf16",
                     module=True)  # python -m nbaccel.cli.main works as well as the script
    assert result.returncode == 0, result.stderr
    assert load_config(target).mixed_precision == "bf16"
    assert not _config_path().exists()


def test_written_yaml_is_what_save_config_writes(tmp_path):
    """The panel writes through save_config: the CLI's file is byte-for-byte the same YAML."""
    nbaccel("config", "--default")
    again = save_config(load_config(_config_path()), tmp_path / "panel.yaml")
    assert again.read_text() == _config_path().read_text()


def test_questions_from_piped_stdin():
    answers = "1\nyes\n3\nbf16\nspawn\n60\n"
    result = nbaccel("config", input=answers)
    assert result.returncode == 0, result.stderr
    assert "How many processes on this machine?" in result.stdout
    assert "Mixed precision (no/fp16/bf16/fp8)?" in result.stdout
    cfg = load_config(_config_path())
    assert (cfg.num_processes, cfg.mixed_precision, cfg.start_method, cfg.timeout, cfg.use_cpu) == \
        (3, "bf16", "spawn", 60.0, True)
    assert cfg.distributed_type == "MULTI_CPU"


def test_empty_input_takes_every_default_and_keeps_the_existing_files_values():
    save_config(LaunchConfig(num_processes=3, mixed_precision="fp16", use_cpu=True), _config_path())
    result = nbaccel("config", input="")
    assert result.returncode == 0, result.stderr
    assert "How many processes on this machine? [3]" in result.stdout
    cfg = load_config(_config_path())
    assert (cfg.num_processes, cfg.mixed_precision) == (3, "fp16")


def test_questions_for_several_machines_write_accelerate_style_totals():
    answers = "2\n1\n10.0.0.5\n29555\nc10d\nyes\n2\nno\nauto\nnone\n"
    result = nbaccel("config", input=answers)
    assert result.returncode == 0, result.stderr
    raw = yaml.safe_load(_config_path().read_text())
    assert raw["num_processes"] == 4  # Accelerate counts the workers of every machine
    cfg = load_config(_config_path())
    assert (cfg.num_machines, cfg.machine_rank, cfg.main_process_ip, cfg.main_process_port, cfg.rdzv_backend,
            cfg.num_processes) == (2, 1, "10.0.0.5", 29555, "c10d", 2)


def test_a_wrong_answer_is_asked_again():
    result = nbaccel("config", input="1\nyes\nmany\n2\n")
    assert result.returncode == 0, result.stderr
    assert "'many' is not a whole number" in result.stdout
    assert load_config(_config_path()).num_processes == 2


def test_three_wrong_answers_are_one_error_and_no_file():
    result = nbaccel("config", input="x\ny\nz\n")
    assert result.returncode == 2
    assert result.stderr.startswith("nbaccel config: error: no valid answer to 'How many machines take part?'")
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not _config_path().exists()


def test_a_wrong_answer_at_the_end_of_input_is_an_error():
    result = nbaccel("config", input="1\nmaybe\n")
    assert result.returncode == 2
    assert "no valid answer to 'Run on CPU only (yes/no)?'" in result.stderr


def test_an_invalid_existing_file_is_replaced():
    _config_path().write_text("num_processes: [1, 2\n")
    result = nbaccel("config", input="")
    assert result.returncode == 0, result.stderr
    assert "The existing config file is invalid and will be replaced" in result.stdout
    load_config(_config_path())


def test_config_file_that_is_a_directory_is_an_error(tmp_path):
    result = nbaccel("config", "--default", "--config_file", str(tmp_path))
    assert result.returncode == 2
    assert "is a directory" in result.stderr and "Traceback" not in result.stderr


def test_unwritable_config_file_is_an_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = nbaccel("config", "--default", "--config_file", str(blocker / "c.yaml"))
    assert result.returncode == 2
    assert "cannot write the config file" in result.stderr and "Traceback" not in result.stderr


def test_bad_flag_value_is_a_usage_error():
    result = nbaccel("config", "--default", "--mixed_precision", "fp9")
    assert result.returncode == 2
    assert result.stderr.startswith("nbaccel config: error: argument --mixed_precision")
    assert "see `nbaccel config --help`" in result.stderr


def test_each_question_explains_a_wrong_answer_and_asks_again(monkeypatch):
    import io

    from nbaccel.cli import config_cmd

    monkeypatch.setattr(config_cmd, "cuda_device_count", lambda: 2)  # so the GPU question is asked too
    answers = ["2", "5", "1", "", "", "etcd", "c10d", "no", "2", "first", "0,1", "", "", "-3", "soon", "600"]
    out = io.StringIO()
    config = config_cmd.ask_config(LaunchConfig(), io.StringIO("\n".join(answers) + "\n"), out)
    said = out.getvalue()
    for complaint in ("5 is out of range; valid: 0..1", "'etcd' is not one of ['static', 'c10d']",
                      "'first' is not 'all' or a list like '0,1' (or GPU UUIDs)",
                      "-3 is not a positive number of seconds",
                      "'soon' is not a number of seconds"):
        assert complaint in said, complaint
    assert (config.num_machines, config.machine_rank, config.rdzv_backend) == (2, 1, "c10d")
    assert (config.num_processes, config.gpu_ids, config.distributed_type, config.timeout) == (2, "0,1", "MULTI_GPU",
                                                                                              600.0)


def test_ray_questions_write_the_backend_address_and_placement():
    answers = "1\nyes\n4\nno\nauto\nnone\nyes\nsomewhere\nray://head:10001\nscatter\nspread\n"
    result = nbaccel("config", input=answers)
    assert result.returncode == 0, result.stderr
    assert "'somewhere' is not 'none', 'auto', 'ray://host:port' or 'host:port'" in result.stdout
    assert "'scatter' is not one of ['PACK', 'SPREAD', 'STRICT_PACK', 'STRICT_SPREAD']" in result.stdout
    cfg = load_config(_config_path())
    assert (cfg.backend, cfg.ray_address, cfg.ray_placement_strategy, cfg.num_processes) == \
        ("ray", "ray://head:10001", "SPREAD", 4)


def test_ray_question_defaults_keep_a_ray_config_and_none_clears_the_address():
    save_config(LaunchConfig(backend="ray", ray_address="auto", use_cpu=True, num_processes=2), _config_path())
    result = nbaccel("config", input="\n\n\n\n\n\n\nnone\n")
    assert result.returncode == 0, result.stderr
    assert "Run the ranks on a Ray cluster (yes/no)? [yes]" in result.stdout
    cfg = load_config(_config_path())
    assert (cfg.backend, cfg.ray_address, cfg.ray_placement_strategy) == ("ray", None, "PACK")


def test_several_machines_are_never_asked_about_ray():
    save_config(LaunchConfig(backend="ray", use_cpu=True), _config_path())
    result = nbaccel("config", input="2\n0\n10.0.0.5\n29555\nstatic\nyes\n2\nno\nauto\nnone\n")
    assert result.returncode == 0, result.stderr
    assert "Ray cluster" not in result.stdout
    assert load_config(_config_path()).backend == "local"
