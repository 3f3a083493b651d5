"""The magics in a real Jupyter kernel, through nbclient: what a notebook user sees."""

from __future__ import annotations

import threading
import time

import pytest

from .nbkernel import NotebookKernel, displays, error, result_text, stream_text

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    config = tmp_path_factory.mktemp("kernel") / "nbaccel_config.yaml"
    with NotebookKernel(config) as nb:
        cell = nb.run("%load_ext nbaccel\nimport os, time, torch")
        assert error(cell) is None, cell.outputs
        yield nb


def test_labelled_output_last_expression_and_out_names(kernel):
    cell = kernel.run("%%accel_launch -n 2 -o y\n"
                      "rank = int(os.environ['RANK'])\n"
                      "print('hello from', rank)\n"
                      "y = rank * 10 + 7\n"
                      "rank + 100\n")
    assert error(cell) is None, cell.outputs
    out = stream_text(cell)
    assert "[rank0]: hello from 0\n" in out and "[rank1]: hello from 1\n" in out
    assert result_text(cell) == "100"
    assert result_text(kernel.run("y")) == "7"


def test_launch_notes_are_plain_output_not_the_stderr_box(kernel):
    chosen = kernel.run("%%accel_launch\nimport sys; print('ran', file=sys.stderr)\n")
    assert error(chosen) is None, chosen.outputs
    assert "nbaccel: no GPU found; using" in stream_text(chosen)
    assert "no GPU found" not in stream_text(chosen, "stderr") and "ran" in stream_text(chosen, "stderr")
    cores = int(result_text(kernel.run("from nbaccel.hardware import cpu_count; cpu_count()")))
    crowded = kernel.run(f"%%accel_launch -n {cores + 1}\npass\n")
    assert error(crowded) is None, crowded.outputs
    assert (f"nbaccel: {cores + 1} CPU processes on {cores} cores: they take turns, so each runs slower. "
            f"Pass num_processes<={cores} for one per core.") in stream_text(crowded)
    assert "nbaccel:" not in stream_text(crowded, "stderr")


def test_status_panel_is_a_widget_with_a_final_text_form(kernel):
    cell = kernel.run("%%accel_launch -n 2\nprint('step', os.environ['RANK'])\n")
    assert error(cell) is None, cell.outputs
    panels = [d for d in displays(cell) if "application/vnd.jupyter.widget-view+json" in d]
    assert len(panels) == 1
    text = panels[0]["text/plain"]
    assert "finished" in text and "[rank1] finished" in text and "last: step 1" in text


def test_failing_rank_shows_its_traceback_at_the_cells_own_lines(kernel):
    cell = kernel.run("%%accel_launch -n 2\n"
                      "rank = int(os.environ['RANK'])\n"
                      "if rank == 1:\n"
                      "    raise ValueError(f'bad batch on rank {rank}')\n"
                      "time.sleep(30)\n")
    err = error(cell)
    assert err is not None and err.ename == "ValueError" and err.evalue == "bad batch on rank 1"
    shown = "\n".join(err.traceback)
    assert f"Cell In[{cell.execution_count}], line 4" in shown
    assert "raise ValueError(f'bad batch on rank {rank}')" in shown
    assert "root cause: rank 1" in shown
    assert "nbaccel/launch" not in shown  # the launcher's own frames are not the story
    assert result_text(kernel.run("1 + 1")) == "2"


def test_kernel_interrupt_stops_workers_within_5s_and_kernel_stays_usable(kernel, tmp_path):
    marker = tmp_path / "pids"
    marker.mkdir()
    done: dict[str, float] = {}

    def interrupt_when_running() -> None:
        deadline = time.monotonic() + 60
        while len(list(marker.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        done["sent"] = time.monotonic()
        kernel.interrupt()

    thread = threading.Thread(target=interrupt_when_running)
    thread.start()
    cell = kernel.run("%%accel_launch -n 2\n"
                      f"open(os.path.join({str(marker)!r}, str(os.getpid())), 'w').close()\n"
                      "time.sleep(120)\n")
    returned = time.monotonic()
    thread.join()
    err = error(cell)
    assert err is not None and err.ename == "KeyboardInterrupt", cell.outputs
    assert returned - done["sent"] < 5.0
    pids = [int(p.name) for p in marker.iterdir()]
    check = kernel.run(f"from tests.launch.procs import alive\n[alive(p) for p in {pids}]")
    assert result_text(check) == "[False, False]", check.outputs
    again = kernel.run("%%accel_launch -n 2\nint(os.environ['WORLD_SIZE'])\n")
    assert error(again) is None and result_text(again) == "2"


def test_spawn_ships_functions_classes_and_data_from_earlier_cells(kernel):
    kernel.run("factor = 3\n"
               "class Box:\n"
               "    def __init__(self, v):\n"
               "        self.v = v\n"
               "def scale(box):\n"
               "    return box.v * factor * offset\n"
               "import threading\nlock = threading.Lock()  # unpicklable, and not used by the cell\n")
    cell = kernel.run("%%accel_launch -n 2 --start_method spawn -o out --all-ranks\n"
                      "offset = int(os.environ['RANK']) + 1\n"
                      "out = scale(Box(2))\n"
                      "out\n")
    assert error(cell) is None, cell.outputs
    assert "spawn" in "".join(d.get("text/plain", "") for d in displays(cell))
    assert result_text(cell) == "6"
    assert result_text(kernel.run("out")) == "{0: 6, 1: 12}"


def test_bad_option_is_a_usage_error_and_nothing_starts(kernel):
    cell = kernel.run("%%accel_launch -n 2 --mixed_precision fp17\nprint('ran')\n")
    shown = stream_text(cell, "stderr")  # IPython prints a UsageError as one line, no traceback
    assert "UsageError: argument --mixed_precision: invalid choice: 'fp17'" in shown
    assert "'no', 'fp16', 'bf16', 'fp8'" in shown
    assert "ran" not in stream_text(cell) and not displays(cell)


def test_accel_config_shows_the_panel_widget(kernel):
    cell = kernel.run("%accel_config")
    assert error(cell) is None, cell.outputs
    (bundle,) = displays(cell)
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert "num_processes: auto" in bundle["text/plain"] and "detected hardware:" in bundle["text/plain"]


def test_accel_env_prints_the_env_report(kernel):
    cell = kernel.run("%accel_env")
    assert error(cell) is None, cell.outputs
    expected = kernel.run("from nbaccel.cli.env_cmd import env_report\nprint(env_report())")
    first = stream_text(expected).splitlines()[:3]
    assert first and stream_text(cell).splitlines()[:3] == first
