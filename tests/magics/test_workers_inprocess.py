"""``%accel_workers`` and ``%%accel_launch --persist`` in an in-process IPython shell."""

from __future__ import annotations

import os

import pytest
from IPython.core.error import UsageError

from .conftest import run


@pytest.fixture
def workers(ip):
    ip.run_line_magic("accel_workers", "start -n 2 --cpu")
    yield ip
    ip.run_line_magic("accel_workers", "stop")


def _magics(ip):
    return ip.magics_manager.registry["AccelMagics"]


def test_persisted_cells_share_names_and_workers_and_send_back_out_names(workers, capsys):
    ip = workers
    first = run(ip, "%%accel_launch --persist\nimport os\nloaded = int(os.environ['RANK']) + 40\nos.getpid()")
    first.raise_error()
    assert first.result == _magics(ip).workers.pool.pids[0]
    second = run(ip, "%%accel_launch --persist -o loaded --all-ranks\nloaded += 1\nos.getpid()")
    second.raise_error()
    assert second.result == first.result
    assert ip.user_ns["loaded"] == {0: 41, 1: 42}


def test_worker_names_win_and_notebook_names_refresh(workers):
    ip = workers
    run(ip, "scale = 2\ndef twice(v):\n    return v * scale * factor").raise_error()
    run(ip, "%%accel_launch --persist\nfactor = 1\nmodel = 'rank copy'").raise_error()
    run(ip, "model = 'notebook copy'\nscale = 3").raise_error()
    cell = run(ip, "%%accel_launch --persist\n(model, twice(5))")
    cell.raise_error()
    assert cell.result == ("rank copy", 15)  # the workers' model; the notebook's new scale; factor from the workers


def test_status_lists_ranks_pids_and_defined_names(workers, capsys):
    ip = workers
    run(ip, "%%accel_launch --persist\nweights = [1, 2]").raise_error()
    capsys.readouterr()
    ip.run_line_magic("accel_workers", "")
    out = capsys.readouterr().out
    pids = _magics(ip).workers.pool.pids
    assert "2 warm workers (fork), alive" in out and all(str(p) in out for p in pids)
    assert "defined (rank 0): " in out and "weights" in out


def test_persist_without_started_workers_says_how_to_start_them(ip):
    with pytest.raises(UsageError, match="accel_workers start -n 2"):
        ip.run_cell_magic("accel_launch", "--persist", "1")


def test_persist_refuses_launch_flags(workers):
    with pytest.raises(UsageError, match="--num_processes has no effect"):
        workers.run_cell_magic("accel_launch", "--persist -n 2", "1")


def test_workers_flags_only_with_start_and_one_pool_at_a_time(workers):
    with pytest.raises(UsageError, match="takes no launch flags"):
        workers.run_line_magic("accel_workers", "stop -n 2")
    with pytest.raises(UsageError, match="running already"):
        workers.run_line_magic("accel_workers", "start -n 2 --cpu")


def test_restart_empties_the_namespaces_and_stop_ends_the_workers(workers, capsys):
    ip = workers
    run(ip, "%%accel_launch --persist\ngone = 1").raise_error()
    old = _magics(ip).workers.pool.pids
    ip.run_line_magic("accel_workers", "restart")
    assert set(_magics(ip).workers.pool.pids).isdisjoint(old)
    assert isinstance(run(ip, "%%accel_launch --persist\ngone").error_in_exec, NameError)
    ip.run_line_magic("accel_workers", "stop")
    assert not any(os.path.exists(f"/proc/{p}") for p in old)
    capsys.readouterr()
    ip.run_line_magic("accel_workers", "")
    assert "no warm workers" in capsys.readouterr().out


def test_restart_without_workers_and_bad_start_flags_are_usage_errors(ip):
    with pytest.raises(UsageError, match="accel_workers start -n 2"):
        ip.run_line_magic("accel_workers", "restart")
    with pytest.raises(UsageError, match="num_processes"):
        ip.run_line_magic("accel_workers", "start -n 0")
    with pytest.raises(UsageError):
        ip.run_line_magic("accel_workers", "launch")  # not an action


def test_persist_refuses_ranks_the_workers_lack(workers):
    with pytest.raises(UsageError, match="output_ranks"):
        workers.run_cell_magic("accel_launch", "--persist --ranks 5", "1")


def test_one_process_cells_reuse_the_warm_rank_which_the_status_shows_and_stop_closes(ip, capsys):
    first = run(ip, "%%accel_launch -n 1 --cpu\nimport os\nos.getpid()")
    first.raise_error()
    again = run(ip, "%%accel_launch -n 1 --cpu\nimport os\nos.getpid()")
    again.raise_error()
    fresh = run(ip, "%%accel_launch -n 1 --cpu --fresh\nimport os\nos.getpid()")
    fresh.raise_error()
    assert again.result == first.result != fresh.result
    capsys.readouterr()
    ip.run_line_magic("accel_workers", "")
    shown = capsys.readouterr().out
    assert f"warm rank: pid {first.result} (cpu, fork), 2 runs" in shown and "--fresh" in shown
    ip.run_line_magic("accel_workers", "stop")
    assert "warm workers stopped" in capsys.readouterr().out
    ip.run_line_magic("accel_workers", "")
    assert "warm rank" not in capsys.readouterr().out and not os.path.exists(f"/proc/{first.result}/status")
