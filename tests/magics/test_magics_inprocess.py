"""The magics in an in-process IPython shell: options, namespaces, results, failures, session."""

from __future__ import annotations

import subprocess
import sys

import pytest
from IPython.core.error import UsageError

from nbaccel.config import LaunchConfig, load_config, save_config
from nbaccel.errors import ConfigError, PayloadPicklingError, WorkerFailedError
from nbaccel.magics.cell import CellProgram, names_used, run_cell_program
from nbaccel.magics.magics import AccelMagics

from .conftest import run


def _magics(ip) -> AccelMagics:
    return ip.magics_manager.registry["AccelMagics"]


def test_load_registers_one_class_and_unload_removes_it(ip):
    magics = ip.magics_manager.magics
    assert "accel_launch" in magics["cell"]
    assert {"accel_config", "accel_env"} <= set(magics["line"])
    import nbaccel.magics

    nbaccel.magics.unload_ipython_extension(ip)
    assert "accel_launch" not in magics["cell"] and "accel_env" not in magics["line"]
    assert "AccelMagics" not in ip.magics_manager.registry
    nbaccel.magics.load_ipython_extension(ip)  # the fixture unloads again


def test_load_ext_imports_neither_torch_nor_ipywidgets():
    code = ("import sys\nfrom IPython.testing.globalipapp import start_ipython\nip = start_ipython()\n"
            "ip.run_line_magic('load_ext', 'nbaccel')\n"
            "print(sorted(m for m in ('torch', 'ipywidgets', 'torch.cuda') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_help_shows_every_option():
    doc = AccelMagics.accel_launch.__doc__
    for option in ("-n NUM_PROCESSES", "--mixed_precision {no,fp16,bf16,fp8}", "--cpu", "--config_file",
                   "--start_method {fork,spawn}", "--timeout", "--ranks", "--port", "--num_nodes",
                   "--node_rank", "--rdzv_endpoint", "-o NAME", "--all-ranks"):
        assert option in doc, option


@pytest.mark.parametrize(("flags", "message"), [
    ("--mixed_precision fp17", "invalid choice: 'fp17' (choose from 'no', 'fp16', 'bf16', 'fp8')"),
    ("-n 0", "'num_processes' must be a positive int (got 0)"),
    ("-n two", "invalid int value: 'two'"),
    ("--start_method forkserver", "(choose from 'fork', 'spawn')"),
    ("--timeout -1", "must be a positive number of seconds (got '-1')"),
    ("--timeout soon", "must be a positive number of seconds (got 'soon')"),
    ("--hang_timeout x", "must be a positive number of seconds (got 'x')"),
    ("-n 2 --ranks 5", "output_ranks names rank 5, but ranks run from 0 to 1"),
    ("--ranks a", "must be rank numbers such as 0 or 0,1 (got 'a')"),
    ("--config_file /nonexistent/nbaccel.yaml", "does not exist"),
    ("--rdzv_endpoint nohost", "--rdzv_endpoint must be host:port (got 'nohost')"),
    ("-o 1bad", "-o/--out takes variable names (got '1bad')"),
    ("--port 70000", "'main_process_port' must be in 1..65535 (got 70000)"),
    ("--status loud", "invalid choice: 'loud'"),
])
def test_bad_option_is_a_usage_error_and_nothing_starts(ip, capfd, flags, message):
    result = run(ip, f"%%accel_launch {flags}\nprint('ran')\n")
    assert isinstance(result.error_in_exec, UsageError)
    assert message in str(result.error_in_exec)
    assert "ran" not in capfd.readouterr().out


@pytest.mark.parametrize(("line", "message"), [
    ("%%accel_launch --mixedprecision bf16", "%%accel_launch: no flag --mixedprecision. Fix: did you mean "
                                             "--mixed_precision?"),
    ("%%accel_launch --num-processes 2", "did you mean --num_processes?"),
    ("%%accel_launch --gpu_ids 0", "--gpu_ids is a flag of `nbaccel launch`; %%accel_launch does not take it"),
    ("%%accel_launch --zzz", "%%accel_launch: no flag --zzz. Fix: use one of --num_processes, --mixed_precision"),
    ("%%accel_launch -n 2 stray", "%%accel_launch: unexpected arguments 'stray'"),
])
def test_a_misspelled_flag_names_the_flag_meant(ip, capfd, line, message):
    result = run(ip, f"{line}\nprint('ran')\n")
    assert isinstance(result.error_in_exec, UsageError)
    assert message in str(result.error_in_exec)
    assert "ran" not in capfd.readouterr().out


def test_a_misspelled_line_magic_flag_names_the_flag_meant(ip):
    result = run(ip, "%accel_workers start --num_procesess 2")
    assert isinstance(result.error_in_exec, UsageError)
    assert "%accel_workers: no flag --num_procesess. Fix: did you mean --num_processes?" in str(result.error_in_exec)


def test_unsafe_fork_request_is_a_usage_error(ip, monkeypatch):
    monkeypatch.setenv("NBACCEL_ASSUME_UNSAFE_FORK", "1")
    result = run(ip, "%%accel_launch -n 2 --start_method fork\n1\n")
    assert isinstance(result.error_in_exec, UsageError)
    assert "start_method='fork' is unsafe here" in str(result.error_in_exec)


def test_cell_sees_earlier_cells_and_returns_last_value_and_out_names(ip, capfd):
    run(ip, "def double(v):\n    return 2 * v\nbase = 20\n")
    result = run(ip, "%%accel_launch -n 2 -o y,rank\n"
                     "import os\n"
                     "rank = int(os.environ['RANK'])\n"
                     "scratch = 'only in the workers'\n"
                     "print('rank', rank, 'of', os.environ['WORLD_SIZE'])\n"
                     "y = double(base) + rank\n"
                     "y * 10\n")
    assert result.error_in_exec is None
    assert result.result == 400
    assert ip.user_ns["y"] == 40 and ip.user_ns["rank"] == 0
    assert "scratch" not in ip.user_ns  # the workers' namespaces are theirs
    out = capfd.readouterr().out
    assert "[rank0]: rank 0 of 2\n" in out and "[rank1]: rank 1 of 2\n" in out
    assert "[rank1] finished" in out  # the plain-text status outside a notebook


def test_all_ranks_collects_every_rank_and_semicolon_hides_the_value(ip):
    result = run(ip, "%%accel_launch -n 2 -o r --all-ranks --status none\n"
                     "import os\nr = int(os.environ['RANK']) ** 2 + 1\nr;\n")
    assert result.error_in_exec is None and result.result is None
    assert ip.user_ns["r"] == {0: 1, 1: 2}


def test_ranks_filters_the_output_shown(ip, capfd):
    result = run(ip, "%%accel_launch -n 2 --ranks 1 --status none\nimport os\nprint('from', os.environ['RANK'])\n")
    assert result.error_in_exec is None
    out = capfd.readouterr().out
    assert "[rank1]: from 1" in out and "[rank0]" not in out


def test_failing_rank_raises_its_own_error_pointing_at_the_cell_line(ip):
    result = run(ip, "%%accel_launch -n 2 --status none\n"
                     "import os\n"
                     "if os.environ['RANK'] == '1':\n"
                     "    raise KeyError('missing column')\n")
    exc = result.error_in_exec
    assert isinstance(exc, KeyError) and exc.launch_failures[0].rank == 1
    shown = "\n".join(exc._render_traceback_())
    assert "KeyError on rank 1" in shown and ", line 4" in shown and "raise KeyError('missing column')" in shown
    assert "worker.py" not in shown


def test_an_error_every_rank_raised_reads_as_everyones_in_the_cell(ip):
    result = run(ip, "%%accel_launch -n 2 --status none\n"
                     "import signal, torch.distributed as dist\n"
                     "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # no rank is stopped first\n"
                     "dist.init_process_group('gloo'); dist.barrier()\n"
                     "raise RuntimeError('the dataset is empty')\n")
    exc = result.error_in_exec
    assert isinstance(exc, RuntimeError) and isinstance(exc, WorkerFailedError)
    shown = "\n".join(exc._render_traceback_())
    assert "RuntimeError on ranks 0, 1 (each raised it;" in shown and "on rank 1 (the root cause" not in shown
    assert "root cause: all 2 ranks raised RuntimeError: the dataset is empty" in shown


def test_a_ranks_sys_exit_fails_the_cell_and_says_why(ip):
    result = run(ip, "%%accel_launch -n 2 --status none\nimport os, sys\n"
                     "if os.environ['RANK'] == '1':\n    sys.exit(3)\n")
    exc = result.error_in_exec
    assert isinstance(exc, WorkerFailedError) and exc.root_cause.exitcode == 3
    shown = "\n".join(exc._render_traceback_())
    assert "root cause: rank 1" in shown and "called sys.exit(3) in rank 1" in shown


def test_a_workers_own_config_error_is_not_a_usage_error(ip):
    result = run(ip, "%%accel_launch -n 2 --status none\n"
                     "from nbaccel.errors import ConfigError\nraise ConfigError('from the cell', key='k')\n")
    exc = result.error_in_exec
    assert isinstance(exc, ConfigError) and isinstance(exc, WorkerFailedError)  # the worker's own, not a UsageError
    assert type(exc).__name__ == "ConfigError" and exc.failures[0].exc_type == "nbaccel.errors.ConfigError"


def test_out_name_the_cell_never_defined_is_a_name_error(ip):
    result = run(ip, "%%accel_launch -n 2 -o nowhere --status none\nx = 1\n")
    exc = result.error_in_exec
    assert isinstance(exc, NameError) and "-o/--out names 'nowhere'" in str(exc)


def test_spawn_refuses_an_unpicklable_name_the_cell_uses_before_starting(ip, capfd):
    run(ip, "import threading\nlock = threading.Lock()\n")
    result = run(ip, "%%accel_launch -n 2 --start_method spawn\nprint('ran')\nwith lock:\n    pass\n")
    exc = result.error_in_exec
    assert isinstance(exc, PayloadPicklingError) and exc.object_path == "lock"
    assert "notebook variable 'lock' (a _thread.lock)" in str(exc)
    assert "ran" not in capfd.readouterr().out


def test_names_used_are_the_cells_global_reads():
    source = "import os\ny = f(x)\ndef g(a):\n    return a + z\nclass C:\n    k = w\n"
    assert names_used(source) == {"f", "x", "z", "w"}


def test_program_runs_in_shipped_namespace_with_shared_globals():
    import cloudpickle

    ns: dict = {}
    exec("def scale(v):\n    return v * factor\n", ns)  # noqa: S102 - a constant source: a notebook function reading a global
    ns["__name__"] = "__main__"
    ns["scale"].__module__ = "__main__"
    program = CellProgram("factor = 4\nscale(5)", filename="<t>", first_line=2,
                          cell_lines=["%%accel_launch\n", "factor = 4\n", "scale(5)\n"], user_ns=ns)
    shipped = cloudpickle.loads(cloudpickle.dumps(program))  # what a spawned worker receives
    assert run_cell_program(shipped).value == 20


def test_session_defaults_sit_between_file_and_flags(ip, tmp_path):
    save_config(LaunchConfig(num_processes=1, mixed_precision="fp16"))
    session = _magics(ip).session
    session.set({"num_processes": 3})
    probe = ("%%accel_launch --status none\nimport os\nfrom nbaccel.environment import read_worker_settings\n"
             "(int(os.environ.get('WORLD_SIZE', '1')), read_worker_settings().mixed_precision)\n")
    assert run(ip, probe).result == (3, "fp16")
    assert run(ip, probe.replace("--status none", "--status none -n 2")).result == (2, "fp16")
    run(ip, "%accel_config --clear_session")
    assert run(ip, probe).result == (1, "fp16")


def test_session_rejects_unknown_fields():
    from nbaccel.magics.session import SessionDefaults

    with pytest.raises(ConfigError, match="unknown config key 'num_procs'"):
        SessionDefaults().set({"num_procs": 2})


def test_accel_config_prints_text_outside_a_notebook(ip, capsys):
    save_config(LaunchConfig(num_processes=2, mixed_precision="bf16"))
    run(ip, "%accel_config")
    out = capsys.readouterr().out
    assert "num_processes: 2" in out and "mixed_precision: bf16" in out and "`nbaccel config`" in out
    assert "detected hardware:" in out


def test_accel_config_bad_file_is_a_usage_error(ip, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_processes: many\n")
    result = run(ip, f"%accel_config --config_file {bad}")
    assert isinstance(result.error_in_exec, UsageError)
    assert "'num_processes' must be an int" in str(result.error_in_exec)
    assert load_config().num_processes is None  # the default file was not touched


def test_accel_env_prints_the_same_report_as_nbaccel_env(ip, capsys):
    env_cmd = pytest.importorskip("nbaccel.cli.env_cmd")
    run(ip, "%accel_env")
    shown = capsys.readouterr().out
    assert shown.splitlines()[:4] == env_cmd.env_report().splitlines()[:4]


def test_accel_env_takes_no_arguments(ip):
    result = run(ip, "%accel_env --verbose")
    assert isinstance(result.error_in_exec, UsageError) and "takes no arguments" in str(result.error_in_exec)


def test_a_config_this_machine_cannot_run_is_a_usage_error(ip, capfd):
    from nbaccel.hardware import cuda_device_count

    if cuda_device_count():
        pytest.skip("this machine has a CUDA GPU")
    save_config(LaunchConfig(distributed_type="MULTI_GPU"))
    result = run(ip, "%%accel_launch -n 2\nprint('ran')\n")
    assert isinstance(result.error_in_exec, UsageError)
    assert "distributed_type='MULTI_GPU' but no CUDA device is visible" in str(result.error_in_exec)
    assert "ran" not in capfd.readouterr().out


def test_syntax_error_points_at_the_cells_own_line_and_nothing_starts(ip, capfd):
    result = run(ip, "%%accel_launch -n 2\nprint('ran')\nx = 1\ny = (\n")
    assert isinstance(result.error_in_exec, UsageError)
    assert "syntax error" in str(result.error_in_exec)
    captured = capfd.readouterr()
    shown = captured.out + captured.err
    assert "line 4" in shown and "y = (" in shown  # the %%accel_launch line is line 1
    assert "ran" not in captured.out and "magics.py" not in shown


def test_names_that_only_fail_to_pickle_together_are_named(ip, monkeypatch):
    run(ip, "a = 1\nb = 2\n")
    program = _magics(ip)._program("-n 2", "print(a + b)\n", (), False)
    calls = {"n": 0}
    real_dumps = __import__("cloudpickle").dumps

    def dumps_failing_once(obj, *args, **kwargs):  # the dict of names fails, each name alone pickles
        calls["n"] += 1
        if calls["n"] == 1:
            raise TypeError("cannot pickle this combination")
        return real_dumps(obj, *args, **kwargs)

    monkeypatch.setattr("nbaccel.magics.cell.cloudpickle.dumps", dumps_failing_once)
    with pytest.raises(PayloadPicklingError) as info:
        program._ship()
    assert info.value.object_path == "a, b" and "cannot pickle this combination" in str(info.value)


def test_no_cpu_overrides_a_configs_use_cpu(ip, tmp_path):
    path = tmp_path / "cpu.yaml"
    save_config(LaunchConfig(use_cpu=True, num_processes=2), path)
    magics = _magics(ip)
    on = magics._config(magics.accel_launch.parser.parse_args(["--config_file", str(path)]))
    off = magics._config(magics.accel_launch.parser.parse_args(["--config_file", str(path), "--no-cpu"]))
    assert on.use_cpu is True and off.use_cpu is False


@pytest.mark.parametrize(("flags", "message"), [
    ("--num_nodes 2 --node_rank 0 --rdzv_endpoint 127.0.0.1:1 --status text", "--status text is not available"),
    ("--num_nodes 2 --node_rank 0 --rdzv_endpoint 127.0.0.1:1 --ranks 0 --status none",
     "output_ranks is not supported for multi-machine launches"),
])
def test_single_machine_options_are_refused_for_multi_node_cells(ip, capfd, flags, message):
    result = run(ip, f"%%accel_launch -n 1 {flags}\nprint('ran')\n")
    assert isinstance(result.error_in_exec, UsageError)
    assert message in str(result.error_in_exec)
    assert "ran" not in capfd.readouterr().out
