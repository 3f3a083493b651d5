"""notebook_launcher(..., background=True): returns at once, gives the blocking result, stops cleanly, holds its
devices."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nbaccel import WorkerFailedError, notebook_launcher
from nbaccel.errors import ConfigError, PayloadPicklingError
from nbaccel.launch.claims import RunBusyError
from nbaccel.runs.record import OUTPUT_CHARS

from ..launch.procs import alive, children
from ..pool.helpers import wait_for
from .helpers import count_and_log, fail_on_rank_one, print_lines, sleep_and_say

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]


def _started_pids(marker_dir: Path, ranks: int) -> list[int]:
    assert wait_for(lambda: len(list(marker_dir.glob("pid-*"))) == ranks, 60)
    time.sleep(0.1)  # the file is written in one call, but let it close
    return [int(p) for f in marker_dir.glob("pid-*") for p in f.read_text().split()]


def test_a_background_launch_returns_at_once_and_gives_what_the_blocking_one_gives():
    blocking = notebook_launcher(count_and_log, (20,), num_processes=2, use_cpu=True)
    started = time.monotonic()
    run = notebook_launcher(count_and_log, (20,), num_processes=2, use_cpu=True, background=True)
    took = time.monotonic() - started
    assert took < 0.5, f"the call took {took:.2f} s"
    assert not run.done() and run.state == "running"  # 20 steps of 50 ms: a second at least
    assert run.result(timeout=120) == blocking == 20
    assert run.state == "finished" and run.done()
    assert [r["step"] for r in run.history] == list(range(20)) and run.history[-1]["loss"] == pytest.approx(0.05)
    assert "step 19 of rank 1" in run.output[1] and run.output[1].log_file is None
    assert "finished" in repr(run) and children() == []


def test_a_failing_rank_raises_the_same_family_as_a_blocking_launch():
    with pytest.raises(WorkerFailedError) as blocking:
        notebook_launcher(fail_on_rank_one, num_processes=2, use_cpu=True)
    run = notebook_launcher(fail_on_rank_one, num_processes=2, use_cpu=True, background=True)
    with pytest.raises(WorkerFailedError) as background:
        run.result(timeout=120)
    assert isinstance(background.value, KeyError) and isinstance(blocking.value, KeyError)
    assert type(background.value).__mro__[1:] == type(blocking.value).__mro__[1:]
    assert background.value.failures[0].rank == blocking.value.failures[0].rank == 1
    assert run.state == "failed" and children() == []


def test_cancel_stops_every_rank_and_what_they_started(tmp_path):
    run = notebook_launcher(sleep_and_say, (str(tmp_path),), num_processes=2, use_cpu=True, background=True)
    pids = _started_pids(tmp_path, 2)
    assert all(alive(pid) for pid in pids)
    assert run.cancel() is True
    assert run.state == "cancelled" and run.cancel() is False
    with pytest.raises(KeyboardInterrupt, match="cancelled"):
        run.result()
    assert wait_for(lambda: not any(alive(pid) for pid in pids), 10), [p for p in pids if alive(p)]
    assert children() == []


def test_an_interrupt_of_the_caller_does_not_touch_a_background_run():
    run = notebook_launcher(count_and_log, (30,), num_processes=2, use_cpu=True, background=True)
    assert wait_for(lambda: "step 2 of rank 0" in run.output[0], 60)
    with pytest.raises(KeyboardInterrupt):  # what Jupyter's Interrupt does to the kernel's main thread
        signal.raise_signal(signal.SIGINT)
        time.sleep(5)
    assert run.result(timeout=120) == 20
    assert "step 29 of rank 0" in run.output[0] and run.state == "finished"


def test_output_past_the_bound_is_kept_whole_in_the_ranks_log_file():
    run = notebook_launcher(print_lines, (3000, 100), num_processes=1, use_cpu=True, background=True, fresh=True)
    assert run.result(timeout=120) == 3000
    text = run.output[0]
    assert text.log_file is not None and f"every line is in {text.log_file}" in text
    assert len(text) < OUTPUT_CHARS + 300 and text.endswith("00002999" + "x" * 92 + "\n")
    logged = Path(text.log_file).read_text().splitlines()
    assert len(logged) == 3000 and logged[0] == "00000000" + "x" * 92 and logged[-1].startswith("00002999")


def test_a_launch_needing_the_warm_rank_of_a_background_run_is_refused_naming_it(tmp_path):
    run = notebook_launcher(sleep_and_say, (str(tmp_path),), num_processes=1, use_cpu=True, background=True)
    _started_pids(tmp_path, 1)
    with pytest.raises(RunBusyError) as refused:
        notebook_launcher(count_and_log, (1,), num_processes=1, use_cpu=True)
    assert refused.value.run_id == run.id and refused.value.resources == ("the warm one-process rank",)
    assert f"%accel_runs cancel {run.id}" in str(refused.value) and "fresh=True" in str(refused.value)
    with pytest.raises(RunBusyError):  # a second background run is refused as it starts
        notebook_launcher(count_and_log, (1,), num_processes=1, use_cpu=True, background=True)
    assert notebook_launcher(count_and_log, (1,), num_processes=1, use_cpu=True, fresh=True) == 10
    assert run.state == "running" and run.cancel()
    assert notebook_launcher(count_and_log, (1,), num_processes=1, use_cpu=True) == 10  # released


def test_result_with_a_timeout_says_the_run_goes_on(tmp_path):
    run = notebook_launcher(sleep_and_say, (str(tmp_path), 30), num_processes=2, use_cpu=True, background=True)
    with pytest.raises(TimeoutError, match="still running"):
        run.result(timeout=0.05)
    assert not run.done() and run.cancel()


def test_a_multi_machine_launch_cannot_run_in_the_background():
    with pytest.raises(ConfigError) as refused:
        notebook_launcher(count_and_log, (1,), num_processes=1, num_nodes=2, node_rank=0, master_addr="127.0.0.1",
                          use_port=29555, background=True)
    assert refused.value.key == "background" and children() == []


_GPU_RUN = r"""
import json, time
from nbaccel import notebook_launcher
from nbaccel.launch.claims import RunBusyError
def nap():
    import time
    time.sleep(30)
run = notebook_launcher(nap, num_processes=2, background=True)
out = {"state": run.state}
try:
    notebook_launcher(nap, num_processes=1)
except RunBusyError as exc:
    out["refused"] = [exc.run_id, list(exc.resources), str(exc)]
out["cancelled"] = run.cancel()
print(json.dumps(out))
"""


def test_a_launch_needing_the_gpus_of_a_background_run_is_refused_naming_it(tmp_path):
    """On a machine that looks like a 2-GPU one to the loader (tests/fake_gpu_driver.py); the ranks never touch CUDA."""
    from tests.fake_gpu_driver import build_fake_driver

    driver = build_fake_driver(tmp_path / "driver")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", LD_LIBRARY_PATH=str(driver))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    done = subprocess.run([sys.executable, "-c", "import tests.fake_cuda_on_import\n" + _GPU_RUN], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["state"] == "running" and out["cancelled"] is True
    run_id, resources, message = out["refused"]
    assert run_id == 1 and resources == ["every GPU"]
    assert "background run 1 (nap)" in message and "%accel_runs cancel 1" in message


def test_closing_the_warm_rank_cancels_the_background_run_on_it(tmp_path):
    from nbaccel.launch.pool.warm import close_warm_rank

    run = notebook_launcher(sleep_and_say, (str(tmp_path),), num_processes=1, use_cpu=True, background=True)
    pids = _started_pids(tmp_path, 1)
    started = time.monotonic()
    assert close_warm_rank() is True  # %accel_workers stop: it used to wait for the run to end
    assert time.monotonic() - started < 20 and run.state == "cancelled"
    assert wait_for(lambda: not any(alive(pid) for pid in pids), 10)


def test_a_launch_that_cannot_start_raises_its_error_from_result():
    import threading

    lock = threading.Lock()
    run = notebook_launcher(lambda: lock.locked(), num_processes=2, use_cpu=True, start_method="spawn",
                            background=True)
    with pytest.raises(PayloadPicklingError):  # as the blocking launch raises it, before any worker starts
        run.result(timeout=60)
    assert run.state == "failed" and run.record.ok is False and children() == []
