"""What workers display, outside a notebook: labelled text in order, from the chosen ranks; widgets noted once."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nbaccel.launch.frames import DISPLAY_MARK
from nbaccel.launch.output import OutputRelay
from nbaccel.launch.rich_output import label_bundle

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, body: str, timeout: float = 120, **extra_env: str) -> subprocess.CompletedProcess[str]:
    """Run ``body`` as a plain ``python`` script (a caller with no IPython shell)."""
    script = tmp_path / "launch.py"
    script.write_text(textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("MPLBACKEND", None)
    env.update(extra_env)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=tmp_path)


DISPLAYS = """
    import os
    from IPython.display import HTML, display

    def show(tag):
        rank = os.environ["RANK"]
        print(f"{tag} before {rank}", end="")
        display(HTML(f"<b>{tag} {rank}</b>"))
        print(f"{tag} after {rank}")
        handle = display(f"{tag} v1 {rank}", display_id=True)
        handle.update(f"{tag} v2 {rank}")
"""


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_rank0_displays_are_printed_labelled_between_its_lines(tmp_path, start_method):
    done = _run(tmp_path, DISPLAYS + f"""
    if __name__ == "__main__":
        from nbaccel import notebook_launcher
        notebook_launcher(show, ("cell",), num_processes=2, start_method={start_method!r})
    """)
    assert done.returncode == 0, done.stderr
    rank0 = [line for line in done.stdout.splitlines() if line.startswith("[rank0]")]
    assert rank0 == ["[rank0]: cell before 0", "[rank0]: <IPython.core.display.HTML object>",
                     "[rank0]: cell after 0", "[rank0]: 'cell v1 0'", "[rank0]: 'cell v2 0'"]
    rank1 = [line for line in done.stdout.splitlines() if line.startswith("[rank1]")]
    assert rank1 == ["[rank1]: cell before 1", "[rank1]: cell after 1"]  # its displays: only when asked
    assert DISPLAY_MARK.decode() not in done.stdout


def test_output_ranks_choose_whose_displays_are_shown(tmp_path):
    done = _run(tmp_path, DISPLAYS + """
    from nbaccel import notebook_launcher
    notebook_launcher(show, ("cell",), num_processes=2, output_ranks=[1])
    """)
    assert done.returncode == 0, done.stderr
    assert "[rank1]: 'cell v2 1'" in done.stdout
    assert "[rank0]" not in done.stdout


def test_worker_shell_is_a_terminal_and_widgets_get_one_note(tmp_path):
    done = _run(tmp_path, """
    from nbaccel import notebook_launcher

    def probe():
        import ipywidgets
        from IPython import get_ipython
        from tqdm.auto import tqdm
        shell = get_ipython()
        for _ in range(2):
            ipywidgets.IntSlider()
        return type(shell).__name__, "IPKernelApp" in shell.config, tqdm.__module__

    print("answer", notebook_launcher(probe, num_processes=1))
    """)
    assert done.returncode == 0, done.stderr
    assert "answer ('WorkerShell', False, 'tqdm.asyncio')" in done.stdout
    assert done.stderr.count("widgets made in a worker are not shown") == 1, done.stderr


def test_figures_are_shown_by_plt_show_and_when_the_function_ends(tmp_path):
    done = _run(tmp_path, """
    from nbaccel import notebook_launcher

    def draw():
        import matplotlib.pyplot as plt
        plt.plot([1, 2, 3])
        plt.show()
        print("between")
        plt.figure(figsize=(2, 2))
        plt.plot([3, 1])
        return plt.get_backend()

    print("backend", notebook_launcher(draw, num_processes=2))
    """)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("[rank0]")]
    assert lines == ["[rank0]: <Figure size 640x480 with 1 Axes>", "[rank0]: between",
                     "[rank0]: <Figure size 200x200 with 1 Axes>"]
    assert "backend module://nbaccel.launch.worker.figure_backend" in done.stdout


def test_a_backend_chosen_on_purpose_stays(tmp_path):
    done = _run(tmp_path, """
    from nbaccel import notebook_launcher

    def draw():
        import matplotlib.pyplot as plt
        plt.plot([1, 2])
        plt.show()
        return plt.get_backend()

    print("backend", notebook_launcher(draw, num_processes=1))
    """, MPLBACKEND="agg")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["backend agg"]  # saving files, not showing: nothing displayed


def test_relay_publishes_a_display_at_its_mark_after_a_partial_line(capsys):
    shown: list[tuple[int, str, dict, bool]] = []
    relay = OutputRelay(on_display=lambda *call: shown.append(call), display_ranks=(0,))
    relay.queue_display(0, "display", {"data": {"text/plain": "42"}})
    relay.feed(0, "stdout", b"loss 0.5, acc=" + DISPLAY_MARK + b"next line\n")
    assert capsys.readouterr().out == "[rank0]: loss 0.5, acc=\n[rank0]: next line\n"
    assert shown == [(0, "display", {"data": {"text/plain": "42"}}, False)]


def test_relay_shows_a_display_whose_frame_came_after_its_mark(capsys):
    shown: list[tuple[int, str, dict, bool]] = []
    relay = OutputRelay(on_display=lambda *call: shown.append(call), display_ranks=(0,))
    relay.feed(0, "stdout", b"before\n" + DISPLAY_MARK + b"after\n")
    assert shown == []
    relay.queue_display(0, "display", {"data": {"text/plain": "late"}})
    assert shown == [(0, "display", {"data": {"text/plain": "late"}}, False)]  # late, not lost
    relay.queue_display(0, "display", {"data": {"text/plain": "next"}})
    assert len(shown) == 1  # a frame in order waits for its own mark again


def test_relay_shows_a_frame_whose_mark_never_came_when_the_rank_ends(capsys):
    shown: list[tuple[int, str, dict, bool]] = []
    relay = OutputRelay(on_display=lambda *call: shown.append(call), display_ranks=(0,))
    relay.feed(0, "stdout", b"last words")
    relay.queue_display(0, "display", {"data": {"text/plain": "final"}})  # the rank died before its mark
    relay.flush_rank(0)
    assert shown == [(0, "display", {"data": {"text/plain": "final"}}, False)]
    assert capsys.readouterr().out == "[rank0]: last words\n"


def test_label_bundle_puts_the_rank_on_images():
    labelled = label_bundle({"image/png": "iVBOR", "text/plain": "<Figure>"}, 3)
    assert labelled["text/html"].endswith('<img src="data:image/png;base64,iVBOR"/>')
    assert "[rank3]" in labelled["text/html"] and labelled["text/plain"] == "[rank3]: <Figure>"
    assert labelled["image/png"] == "iVBOR"  # the saved notebook keeps the image itself


def test_a_process_forked_from_a_worker_prints_its_displays_as_text(tmp_path):
    done = _run(tmp_path, """
    import os
    from nbaccel import notebook_launcher

    def worker():
        from IPython.display import HTML, display
        pid = os.fork()  # what a DataLoader worker is: the rank's control pipe is not its to write
        if pid == 0:
            display(HTML("<i>from the child</i>"))
            os._exit(0)
        os.waitpid(pid, 0)
        display("from the rank")
        return "ok"

    print("result", notebook_launcher(worker, num_processes=1))
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[rank0]: <IPython.core.display.HTML object>", "[rank0]: 'from the rank'",
                                        "result ok"]


def test_a_failing_rich_repr_shows_its_traceback_and_the_text_form_as_in_a_notebook(tmp_path):
    done = _run(tmp_path, """
    from nbaccel import notebook_launcher

    class Table:
        def _repr_html_(self):
            raise ValueError("broken html")

        def __repr__(self):
            return "Table()"

    def show():
        from IPython.display import display
        display(Table())
        print("still running")
        return "ok"

    print("result", notebook_launcher(show, num_processes=1))
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[rank0]: Table()", "[rank0]: still running", "result ok"]
    assert "[rank0]: ValueError: broken html" in done.stderr
    assert "AttributeError" not in done.stderr
