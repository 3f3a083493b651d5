"""%%accel_launch --background and %accel_runs in an in-process IPython shell."""

from __future__ import annotations

import time

import pytest
from IPython.core.error import UsageError

import nbaccel.runs.registry
from nbaccel.launch.claims import RunBusyError

from ..magics.conftest import run
from ..pool.helpers import wait_for

pytestmark = pytest.mark.timeout(180)

SLOW_CELL = ("%%accel_launch --background {name} -n 2 --cpu -o total\n"
             "import time\n"
             "total = 0\n"
             "for step in range(10):\n"
             "    print('step', step, flush=True); total += step; time.sleep(0.05)\n"
             "total * 2\n")


def test_a_background_cell_returns_its_handle_at_once_and_sets_its_names_when_it_ends(ip):
    blocking = run(ip, SLOW_CELL.replace("--background {name} ", ""))
    assert blocking.result == 90
    del ip.user_ns["total"]
    started = time.monotonic()
    result = run(ip, SLOW_CELL.format(name="training"))
    # The cell does not wait for the ranks (the call itself: test_background_launch).
    assert time.monotonic() - started < 5
    handle = ip.user_ns["training"]
    assert result.result is handle and repr(handle).startswith(f"<LaunchRun {handle.id}: ")
    assert handle.result(timeout=120) == blocking.result == 90
    assert ip.user_ns["total"] == 45  # -o names come back when the run ends
    assert "step 9" in handle.output[0]


def test_accel_runs_lists_shows_and_cancels(ip, capsys):
    assert run(ip, "%%accel_launch -n 2 --cpu\nprint('blocking says hi')").success
    recorded = nbaccel.runs.registry.find_run(None)
    capsys.readouterr()
    run(ip, "%accel_runs show")  # a blocking cell's run is kept too, to be shown again
    shown = capsys.readouterr().out
    assert "[rank0]: blocking says hi" in shown and "[rank1]: blocking says hi" in shown
    long = run(ip, "%%accel_launch --background -n 2 --cpu\nimport time\nprint('started', flush=True)\ntime.sleep(60)")
    handle = long.result
    assert wait_for(lambda: "started" in handle.output[0], 60)
    run(ip, "%accel_runs")
    table = capsys.readouterr().out
    assert f"{handle.id:>3}  In[" in table and "running" in table and "background" in table
    assert f"{recorded.id:>3}  In[" in table and "blocking" in table
    run(ip, f"%accel_runs cancel {handle.id}")
    assert f"run {handle.id} cancelled; every rank was stopped" in capsys.readouterr().out
    assert handle.state == "cancelled"
    run(ip, f"%accel_runs cancel {handle.id}")
    assert "was not running (cancelled)" in capsys.readouterr().out


@pytest.mark.parametrize(("line", "says"), [
    ("%accel_runs list 3", "takes no id"),
    ("%accel_runs cancel", "needs the id"),
    ("%accel_runs show 9999", "there is no run 9999; valid ids"),
])
def test_misuse_of_accel_runs_is_a_usage_error(ip, line, says):
    assert run(ip, "%%accel_launch -n 1 --cpu --fresh\n1").success  # at least one run exists
    result = run(ip, line)
    assert isinstance(result.error_in_exec, UsageError) and says in str(result.error_in_exec)


def test_accel_runs_in_a_kernel_without_runs_says_how_to_start_one(ip, monkeypatch, capsys):
    monkeypatch.setattr(nbaccel.runs.registry, "_runs", {})
    run(ip, "%accel_runs")
    assert "no runs in this kernel yet" in capsys.readouterr().out
    result = run(ip, "%accel_runs show")
    assert isinstance(result.error_in_exec, UsageError) and "no runs yet" in str(result.error_in_exec)


def test_a_background_name_must_be_a_variable_name(ip):
    result = run(ip, "%%accel_launch --background 1run -n 1 --cpu\n1")
    assert isinstance(result.error_in_exec, UsageError) and "variable name" in str(result.error_in_exec)


def test_a_persisted_cell_on_workers_held_by_a_background_cell_is_refused_naming_it(ip):
    assert run(ip, "%accel_workers start -n 2 --cpu --grace 1").success
    try:
        long = run(ip, "%%accel_launch --persist --background\nimport time\nprint('holding', flush=True)\n"
                       "time.sleep(60)")
        handle = long.result
        assert wait_for(lambda: "holding" in handle.output[1], 60)
        refused = run(ip, "%%accel_launch --persist\n1")
        assert isinstance(refused.error_in_exec, RunBusyError)
        assert refused.error_in_exec.run_id == handle.id
        assert f"%accel_runs cancel {handle.id}" in str(refused.error_in_exec)
        assert handle.cancel()
        with pytest.raises(KeyboardInterrupt, match="still up"):
            handle.result()
        again = run(ip, "%%accel_launch --persist\n41 + 1")
        assert again.result == 42
    finally:
        run(ip, "%accel_workers stop")
