"""Warm workers in a real Jupyter kernel (nbclient): cells that share workers, interrupts, failures, shutdown."""

from __future__ import annotations

import ast
import os
import signal
import threading
import time

import pytest

from ..launch.procs import alive
from .nbkernel import NotebookKernel, error, result_text, stream_text

pytestmark = pytest.mark.timeout(240)


def _pids(kernel: NotebookKernel) -> list[int]:
    cell = kernel.run("[w.pid for w in get_ipython().magics_manager.registry['AccelMagics'].workers.pool.workers()]")
    return ast.literal_eval(result_text(cell))


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    config = tmp_path_factory.mktemp("kernel") / "nbaccel_config.yaml"
    with NotebookKernel(config) as nb:
        cell = nb.run("%load_ext nbaccel\nimport os, time\n%accel_workers start -n 2 --cpu --grace 2")
        assert error(cell) is None, cell.outputs
        assert "2 warm workers started" in stream_text(cell)
        yield nb


def test_names_workers_and_the_process_group_last_across_cells(kernel):
    pids = _pids(kernel)
    first = kernel.run("%%accel_launch --persist\n"
                       "import torch, torch.distributed as dist\n"
                       "from nbaccel import Accelerator\n"
                       "accelerator = Accelerator()\n"
                       "model = accelerator.prepare(torch.nn.Linear(3, 1))\n"
                       "group = id(dist.group.WORLD)\n"
                       "print('loaded on', os.getpid())\n"
                       "type(model).__name__\n")
    assert error(first) is None, first.outputs
    assert result_text(first) == "'DistributedDataParallel'"
    out = stream_text(first)
    assert f"[rank0]: loaded on {pids[0]}" in out and f"[rank1]: loaded on {pids[1]}" in out
    second = kernel.run("%%accel_launch --persist -o same\n"
                        "same = (id(dist.group.WORLD) == group, Accelerator().num_processes, os.getpid())\n"
                        "accelerator.backward(model(torch.ones(2, 3)).sum())\n"
                        "type(model).__name__\n")
    assert error(second) is None, second.outputs
    assert result_text(second) == "'DistributedDataParallel'"
    assert result_text(kernel.run("same")) == repr((True, 2, pids[0]))
    assert _pids(kernel) == pids


def test_status_shows_ranks_pids_and_names(kernel):
    pids = _pids(kernel)
    cell = kernel.run("%accel_workers")
    out = stream_text(cell)
    assert "2 warm workers (fork), alive" in out and all(str(p) in out for p in pids), out
    assert "model" in out


def test_an_exception_in_a_cell_keeps_the_workers(kernel):
    pids = _pids(kernel)
    cell = kernel.run("%%accel_launch --persist\nraise KeyError('no such column')\n")
    err = error(cell)
    assert err is not None and err.ename == "KeyError"
    assert "no such column" in "\n".join(err.traceback)
    again = kernel.run("%%accel_launch --persist\nos.getpid()")
    assert error(again) is None and result_text(again) == str(pids[0])


def test_the_stop_button_cancels_the_cell_and_keeps_the_workers(kernel, tmp_path):
    pids = _pids(kernel)
    assert error(kernel.run("%%accel_launch --persist\nkept = 'before the interrupt'")) is None

    def interrupt_when_running() -> None:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        kernel.interrupt()

    thread = threading.Thread(target=interrupt_when_running)
    thread.start()
    cell = kernel.run("%%accel_launch --persist\n"
                      f"open(os.path.join({str(tmp_path)!r}, os.environ['RANK']), 'w').close()\n"
                      "time.sleep(120)\n")
    thread.join()
    err = error(cell)
    assert err is not None and err.ename == "KeyboardInterrupt", cell.outputs
    assert "cancelled in every rank" in err.evalue and "still up" in err.evalue
    again = kernel.run("%%accel_launch --persist\n(os.getpid(), kept)")
    assert error(again) is None, again.outputs
    assert result_text(again) == repr((pids[0], "before the interrupt"))
    assert _pids(kernel) == pids


def test_a_dead_worker_fails_the_cell_then_restart_brings_fresh_ones(kernel):
    old = _pids(kernel)
    cell = kernel.run("%%accel_launch --persist\n"
                      "import signal\n"
                      "if os.environ['RANK'] == '1':\n"
                      "    os.kill(os.getpid(), signal.SIGKILL)\n"
                      "time.sleep(30)\n")
    err = error(cell)
    assert err is not None and err.ename == "ProcessExitedError", cell.outputs
    refused = error(kernel.run("%%accel_launch --persist\n1"))
    assert refused is not None and refused.ename == "WorkerPoolError" and "restart" in refused.evalue
    restarted = kernel.run("%accel_workers restart")
    assert error(restarted) is None, restarted.outputs
    assert not any(alive(p) for p in old)
    fresh = kernel.run("%%accel_launch --persist\nint(os.environ['WORLD_SIZE'])")
    assert error(fresh) is None and result_text(fresh) == "2"
    assert set(_pids(kernel)).isdisjoint(old)


@pytest.mark.parametrize("how", ["shutdown", "sigkill"])
def test_nothing_outlives_the_kernel(tmp_path, how):
    with NotebookKernel(tmp_path / "nbaccel_config.yaml") as nb:
        cell = nb.run("%load_ext nbaccel\n%accel_workers start -n 2 --cpu")
        assert error(cell) is None, cell.outputs
        pids = _pids(nb)
        kernel_pid = int(result_text(nb.run("import os\nos.getpid()")))
        assert all(alive(p) for p in pids)
        if how == "sigkill":
            os.kill(kernel_pid, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)
