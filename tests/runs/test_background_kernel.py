"""Background runs in a real Jupyter kernel (nbclient): other cells run meanwhile, Ctrl-C spares the run, restart
ends it."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from ..launch.procs import alive
from ..magics.nbkernel import NotebookKernel, displays, error, result_text, stream_text

pytestmark = pytest.mark.timeout(300)

TRAIN = ("def train(steps):\n"
         "    import time\n"
         "    from nbaccel import Accelerator\n"
         "    accelerator = Accelerator()\n"
         "    for step in range(steps):\n"
         "        print(f'step {step}', flush=True)\n"
         "        accelerator.log({'loss': 1 / (step + 1)}, step=step)\n"
         "        time.sleep(0.1)\n"
         "    return accelerator.num_processes\n")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    config = tmp_path_factory.mktemp("kernel") / "nbaccel_config.yaml"
    with NotebookKernel(config) as nb:
        cell = nb.run("%load_ext nbaccel\nimport os, time\nfrom nbaccel import notebook_launcher\n" + TRAIN)
        assert error(cell) is None, cell.outputs
        yield nb


def _wait_in_kernel(kernel: NotebookKernel, condition: str, timeout: float = 60) -> None:
    cell = kernel.run(f"_deadline = time.monotonic() + {timeout}\n"
                      f"while not ({condition}) and time.monotonic() < _deadline:\n    time.sleep(0.05)\n"
                      f"bool({condition})")
    assert result_text(cell) == "True", cell.outputs


def test_another_cell_runs_while_a_background_cell_trains_and_gets_none_of_its_output(kernel):
    blocking = kernel.run("%%accel_launch -n 2 --cpu --status none\ntrain(3)")
    assert result_text(blocking) == "2", blocking.outputs
    kernel.run("_t = time.monotonic()")
    launched = kernel.run("%%accel_launch --background run -n 2 --cpu\ntrain(40)")
    assert error(launched) is None, launched.outputs
    assert result_text(launched).startswith("<LaunchRun") and "running" in result_text(launched)
    assert any("application/vnd.jupyter.widget-view+json" in d for d in displays(launched))  # the live view
    other = kernel.run("print('meanwhile'); (run.done(), 6 * 7)")
    assert result_text(other) == "(False, 42)"  # it ran while the ranks train
    assert stream_text(other) == "meanwhile\n"  # and none of their lines landed in it
    _wait_in_kernel(kernel, "run.done()", 120)
    assert result_text(kernel.run("run.result(), len(run.history), run.state")) == "(2, 40, 'finished')"
    assert "[rank" not in stream_text(launched)


def test_a_background_call_returns_within_half_a_second(kernel):
    cell = kernel.run("_t = time.monotonic()\n"
                      "fast = notebook_launcher(train, (20,), num_processes=2, use_cpu=True, background=True)\n"
                      "_took = time.monotonic() - _t\n"
                      "(_took < 0.5, fast.done(), round(_took, 3))")
    assert result_text(cell).startswith("(True, False"), cell.outputs
    assert result_text(kernel.run("fast.result()")) == "2"


def test_the_stop_button_in_another_cell_leaves_the_background_run_alone(kernel):
    kernel.run("spared = notebook_launcher(train, (30,), num_processes=2, use_cpu=True, background=True)")
    _wait_in_kernel(kernel, "'step 1' in spared.output[0]")

    def interrupt_soon() -> None:
        time.sleep(1.5)
        kernel.interrupt()

    thread = threading.Thread(target=interrupt_soon)
    thread.start()
    sleeper = kernel.run("time.sleep(60)")
    thread.join()
    assert error(sleeper) is not None and error(sleeper).ename == "KeyboardInterrupt"
    done = kernel.run("spared.result(), spared.state, 'step 29' in spared.output[1]")
    assert result_text(done) == "(2, 'finished', True)", done.outputs


def test_accel_runs_show_brings_back_a_live_view_with_what_was_printed_meanwhile(kernel):
    kernel.run("%%accel_launch --background again -n 2 --cpu --status none\ntrain(30)")
    _wait_in_kernel(kernel, "'step 5' in again.output[0]")
    shown = kernel.run("%accel_runs show")
    views = [d for d in displays(shown) if "application/vnd.jupyter.widget-view+json" in d]
    assert len(views) == 2, shown.outputs  # the status panel, and the output so far under it
    assert "[rank0]: step 5" in views[1]["text/plain"] and "[rank1]: step 5" in views[1]["text/plain"]
    assert "background run" in views[0]["text/plain"]
    listed = kernel.run("%accel_runs")
    assert "running" in stream_text(listed)
    _wait_in_kernel(kernel, "again.done()", 120)


def _rank_pids(nb: NotebookKernel, name: str) -> list[int]:
    text = result_text(nb.run(f"[int(t.split()[1]) for t in {name}.output.values() if t]"))
    return [int(p) for p in text.strip("[]").split(",") if p.strip()]


@pytest.mark.parametrize("how", ["restart", "sigkill"])
def test_nothing_of_a_background_run_outlives_the_kernel(tmp_path, how):
    with NotebookKernel(tmp_path / "nbaccel_config.yaml") as nb:
        cell = nb.run("%load_ext nbaccel\nimport os, time\n"
                      "def nap():\n    import os, time\n    print('pid', os.getpid(), flush=True)\n"
                      "    time.sleep(120)\n"
                      "%accel_runs\n")
        assert error(cell) is None, cell.outputs
        nb.run("%%accel_launch --background held -n 2 --cpu --status none\nnap()")
        _wait_in_kernel(nb, "all(t.startswith('pid') for t in held.output.values())")
        pids = _rank_pids(nb, "held")
        kernel_pid = int(result_text(nb.run("os.getpid()")))
        assert len(pids) == 2 and all(alive(p) for p in pids)
        if how == "sigkill":
            os.kill(kernel_pid, signal.SIGKILL)
        else:
            asyncio.run(nb.client.km.restart_kernel(now=False))
        deadline = time.monotonic() + 20
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in pids)
        assert not alive(kernel_pid)  # restarted: a new process
