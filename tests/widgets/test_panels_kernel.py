"""The panels in a real kernel on ipywidgets 8 and on 7.7.1, the version Colab imports at kernel start.

ipywidgets 7.7.1 (with ``ipython_genutils``, its one import that 8 dropped) is installed once
with pip into a folder put first on the kernel's ``PYTHONPATH``, so it shadows the venv's 8;
the test is skipped when the package registry cannot be reached.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.magics.nbkernel import NotebookKernel, displays, error, stream_text

pytestmark = pytest.mark.timeout(300)

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


@pytest.fixture(scope="module")
def ipywidgets_7(tmp_path_factory) -> Path:
    folder = Path.home() / ".cache" / "nbaccel-tests" / "ipywidgets-7.7.1"
    if not (folder / "ipywidgets" / "__init__.py").exists():
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                               "--no-deps", "--target", str(folder), "ipywidgets==7.7.1", "ipython_genutils"],
                              capture_output=True, text=True, timeout=240)
        if done.returncode != 0:
            pytest.skip(f"could not install ipywidgets 7.7.1: {done.stderr.strip().splitlines()[-1:]}")
    return folder


@pytest.fixture(scope="module", params=["8", "7.7.1"])
def kernel(request, tmp_path_factory):
    shadow = request.getfixturevalue("ipywidgets_7") if request.param == "7.7.1" else None
    config = tmp_path_factory.mktemp("kernel") / "nbaccel_config.yaml"
    with NotebookKernel(config, first_on_path=shadow) as nb:
        cell = nb.run("import ipywidgets\nprint(ipywidgets.__version__)\n%load_ext nbaccel")
        assert error(cell) is None, cell.outputs
        assert stream_text(cell).split(".")[0] == request.param.split(".")[0], stream_text(cell)
        yield nb


def test_accel_config_renders_as_a_widget(kernel):
    cell = kernel.run("%accel_config")
    assert error(cell) is None, cell.outputs
    assert "AttributeError" not in stream_text(cell, "stderr")
    (bundle,) = displays(cell)
    assert bundle[WIDGET_VIEW]["model_id"] and "num_processes: auto" in bundle["text/plain"]


def test_launch_status_panel_renders_as_a_widget(kernel):
    cell = kernel.run("%%accel_launch -n 2\nimport os\nprint('step', os.environ['RANK'])\n")
    assert error(cell) is None, cell.outputs
    assert "AttributeError" not in stream_text(cell, "stderr")
    panels = [d for d in displays(cell) if WIDGET_VIEW in d]
    assert panels and "[rank1] finished" in panels[-1]["text/plain"]
    assert "[rank0]: step 0" in stream_text(cell)


def test_live_chart_is_kept_in_the_saved_notebook_and_the_history_comes_back(kernel):
    cell = kernel.run("%%accel_launch -n 2 -o sent\nfrom nbaccel import Accelerator\naccelerator = Accelerator()\n"
                      "for step in range(5):\n    accelerator.log({'loss': 1 / (step + 1)}, step=step)\n"
                      "sent = accelerator.get_tracker('notebook', unwrap=True)\n")
    assert error(cell) is None, cell.outputs
    panels = [d for d in displays(cell) if WIDGET_VIEW in d]
    assert panels[-1]["image/png"]  # the chart as an image, for nbconvert, GitHub and a reopened notebook
    assert "logged (5 records" in panels[-1]["text/plain"]
    cell = kernel.run("import nbaccel\n"
                      "print([r['step'] for r in nbaccel.last_run_history()], [r['step'] for r in sent])")
    assert stream_text(cell).strip() == "[0, 1, 2, 3, 4] [0, 1, 2, 3, 4]"  # the launch's history, and -o's copy


def test_tqdm_auto_in_workers_is_one_text_bar_per_rank_in_the_panel(kernel):
    launch = ("%%accel_launch -n 2\nimport os\nfrom tqdm.auto import tqdm\n"
              "for _ in tqdm(range(30), desc=f\"rank {os.environ['RANK']}\", mininterval=0):\n    pass\n"
              "tqdm.__module__")
    for before in ("", "import tqdm.auto  # the notebook imported it before the launch\n"):
        if before:
            assert error(kernel.run(before)) is None
        cell = kernel.run(launch)
        assert error(cell) is None, cell.outputs
        panel = [d for d in displays(cell) if WIDGET_VIEW in d][-1]["text/plain"]
        assert "progress: rank 0: 100%" in panel and "progress: rank 1: 100%" in panel, panel
        assert "30/30" in stream_text(cell, "stdout")  # and the text bar in the cell's output (progress, not stderr)
        assert "30/30" not in stream_text(cell, "stderr")
        assert "tqdm.notebook" not in str([d.get("text/plain") for d in displays(cell)])
