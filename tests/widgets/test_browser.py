"""The config panel and the status panel in a real browser: JupyterLab driven through Chromium.

Needs Debian's chromium, jupyterlab and playwright (``.ci/browser_setup.sh .venv`` installs
them); skipped cleanly without them. Screenshots go to ``artifacts/`` at the repository root.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest

from nbaccel.config import load_config

pytestmark = [pytest.mark.browser, pytest.mark.timeout(240)]

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
ROOT = Path(__file__).resolve().parents[2]

PROBE = ("%%accel_launch\n"
         "import os\n"
         "from nbaccel.environment import read_worker_settings\n"
         "print('settings', os.environ.get('WORLD_SIZE', '1'), read_worker_settings().mixed_precision)\n"
         "(int(os.environ.get('WORLD_SIZE', '1')), read_worker_settings().mixed_precision)\n")


def _require_browser_stack() -> None:
    if not os.path.exists(CHROMIUM):
        pytest.skip("chromium is not installed (run .ci/browser_setup.sh .venv)")
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed (run .ci/browser_setup.sh .venv)")
    pytest.importorskip("jupyterlab", reason="jupyterlab is not installed (run .ci/browser_setup.sh .venv)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[str, Path, Path]]:
    """A JupyterLab server on loopback, rooted at a fresh folder with its own config file.

    Its notebook holds the cells given as the fixture's parameter (``indirect``), else
    ``%load_ext nbaccel``, ``%accel_config`` and ``PROBE``.
    """
    _require_browser_stack()
    config_file = tmp_path / "nbaccel_config.yaml"
    jupyter_config = tmp_path / "jupyter_config"
    (jupyter_config / "labconfig").mkdir(parents=True)
    (jupyter_config / "labconfig" / "page_config.json").write_text(json.dumps(
        {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    param = getattr(request, "param", None) or {}
    sources = param.get("cells") or ["%load_ext nbaccel", "%accel_config", PROBE]
    nb.cells = [nbformat.v4.new_code_cell(source) for source in sources]
    nbformat.write(nb, notebooks / "panel.ipynb")
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, NBACCEL_CONFIG_FILE=str(config_file), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               JUPYTER_CONFIG_DIR=str(jupyter_config), JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"))
    with open(tmp_path / "lab.log", "w") as log:  # the server writes through its own copy of the descriptor
        server = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={port}",
             f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={notebooks}"],
            env=env, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    pytest.fail(f"JupyterLab did not start:\n{(tmp_path / 'lab.log').read_text()[-3000:]}")
                time.sleep(0.2)
        yield f"{base}/lab/tree/panel.ipynb?token={token}", config_file, tmp_path
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _run_cell(page, index: int, wait_ms: int = 60_000) -> None:
    """Run cell ``index`` with Shift+Enter and wait until it has an execution count."""
    import re

    from playwright.sync_api import expect

    cell = page.locator(".jp-Notebook .jp-Cell").nth(index)
    cell.locator(".jp-InputArea-editor").click()
    page.keyboard.press("Shift+Enter")
    expect(cell.locator(".jp-InputPrompt")).to_have_text(re.compile(r"\[\d+\]"), timeout=wait_ms)


def test_panel_edits_save_the_yaml_and_the_next_launch_uses_them(lab):
    from playwright.sync_api import expect, sync_playwright

    url, config_file, _ = lab
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        try:
            page.goto(url)
            page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=60_000)
            expect(page.get_by_text("Python 3 (ipykernel) | Idle")).to_be_visible(timeout=60_000)
            _run_cell(page, 0)
            _run_cell(page, 1)
            panel = page.locator(".nbaccel-config")
            panel.wait_for(timeout=20_000)
            page.locator(".nbaccel-field-num_processes input").fill("3")
            page.locator(".nbaccel-field-mixed_precision select").select_option(label="bf16")
            page.locator(".nbaccel-field-timeout input").fill("-1")  # invalid: flagged as typed
            expect(page.locator(".nbaccel-message")).to_contain_text("'timeout' must be a positive number")
            expect(page.locator("button.nbaccel-save")).to_be_disabled()
            page.locator(".nbaccel-field-timeout input").fill("")
            expect(page.locator("button.nbaccel-save")).to_be_enabled()
            panel.screenshot(path=str(ARTIFACTS / "config_panel.png"))
            assert not config_file.exists()
            page.locator("button.nbaccel-save").click()
            expect(page.locator(".nbaccel-message")).to_contain_text("Saved to")
            saved = load_config(config_file)
            assert (saved.num_processes, saved.mixed_precision) == (3, "bf16")
            assert "num_processes: 3" in config_file.read_text() and "mixed_precision: bf16" in config_file.read_text()

            _run_cell(page, 2, wait_ms=120_000)
            probe = page.locator(".jp-Notebook .jp-Cell").nth(2)
            expect(probe.locator(".jp-OutputArea-executeResult")).to_contain_text("(3, 'bf16')", timeout=90_000)
            expect(probe.locator(".nbaccel-status")).to_contain_text("finished")
            expect(probe.locator(".jp-OutputArea-output")).to_contain_text(["[rank0]: settings 3 bf16"])
            # every rank's lines are in the cell's stream, so the panel repeats none of them (each line once)
            expect(probe.locator(".nbaccel-status [class*='nbaccel-output-rank']")).to_have_count(0)
            probe.locator(".nbaccel-status").screenshot(path=str(ARTIFACTS / "status_panel.png"))
            page.screenshot(path=str(ARTIFACTS / "notebook.png"), full_page=True)

            # "Use for this session": the next launch takes the panel's values; the file keeps its own.
            page.locator(".nbaccel-field-num_processes input").fill("2")
            page.locator("button.nbaccel-use").click()
            expect(page.locator(".nbaccel-message")).to_contain_text("session")
            _run_cell(page, 2, wait_ms=120_000)
            expect(probe.locator(".jp-OutputArea-executeResult")).to_contain_text("(2, 'bf16')", timeout=90_000)
            assert load_config(config_file).num_processes == 3
        except BaseException:
            page.screenshot(path=str(ARTIFACTS / "browser_failure.png"), full_page=True)
            raise
        finally:
            browser.close()


SLOW_LAUNCH = ("%%accel_launch -n 2 --ranks 0\n"  # rank 1's lines are in the panel only: each line shows once
               "import os, time\n"
               "for i in range(3):\n"
               "    print('rank', os.environ['RANK'], 'tick', i, flush=True)\n"
               "time.sleep(20)\n")


# On ipywidgets 8 only: JupyterLab 4's widget manager renders no ipywidgets 7 widget at all
# ("Module @jupyter-widgets/controls, version ^1.5.0 is not registered, however, 2.0.0 is"), so
# 7.7.1 is tested in a real kernel instead (tests/widgets/test_panels_kernel.py).
@pytest.mark.parametrize("lab", [{"cells": ["%load_ext nbaccel", SLOW_LAUNCH]}], indirect=True)
def test_a_ranks_output_shows_when_opened_while_the_launch_runs(lab):
    import re

    from playwright.sync_api import expect, sync_playwright

    url, _, _ = lab
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        try:
            page.goto(url)
            page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=60_000)
            expect(page.get_by_text("Python 3 (ipykernel) | Idle")).to_be_visible(timeout=60_000)
            _run_cell(page, 0)
            cell = page.locator(".jp-Notebook .jp-Cell").nth(1)
            cell.locator(".jp-InputArea-editor").click()
            page.keyboard.press("Shift+Enter")
            panel = cell.locator(".nbaccel-status")
            expect(panel).to_contain_text("running", timeout=30_000)
            expect(cell.locator(".nbaccel-ranks")).to_contain_text("tick 2", timeout=15_000)
            started = time.monotonic()
            panel.locator(".jupyter-widget-Collapse-header, .p-Collapse-header").first.click()
            # The kernel is busy in the launch: the section must show what the frontend already holds.
            expect(panel.locator(".nbaccel-output-rank1")).to_contain_text("rank 1 tick 2", timeout=5_000)
            assert time.monotonic() - started < 5
            expect(cell.locator(".jp-InputPrompt")).to_have_text(re.compile(r"\[\*\]"))  # still running
            panel.screenshot(path=str(ARTIFACTS / "status_panel_running.png"))
        except BaseException:
            page.screenshot(path=str(ARTIFACTS / "browser_failure.png"), full_page=True)
            raise
        finally:
            browser.close()


LIVE_TRAINING = ("%%accel_launch -n 2\n"
                 "import os, sys, time\n"
                 "from tqdm.std import tqdm\n"
                 "from nbaccel import Accelerator\n"
                 "accelerator = Accelerator()\n"
                 "for step in tqdm(range(100), desc=f\"rank {os.environ['RANK']}\", file=sys.stderr,"
                 " mininterval=0.2):\n"
                 "    accelerator.log({'loss': 1 / (step + 1), 'accuracy': step / 100}, step=step)\n"
                 "    time.sleep(0.2)\n")


@pytest.mark.parametrize("lab", [{"cells": ["%load_ext nbaccel", LIVE_TRAINING]}], indirect=True)
def test_the_live_chart_and_each_ranks_bar_update_while_the_launch_runs(lab):
    import re

    from playwright.sync_api import expect, sync_playwright

    url, _, _ = lab
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        try:
            page.goto(url)
            page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=60_000)
            expect(page.get_by_text("Python 3 (ipykernel) | Idle")).to_be_visible(timeout=60_000)
            _run_cell(page, 0)
            cell = page.locator(".jp-Notebook .jp-Cell").nth(1)
            cell.locator(".jp-InputArea-editor").click()
            page.keyboard.press("Shift+Enter")
            panel = cell.locator(".nbaccel-status")
            chart = panel.locator("img.nbaccel-chart")
            expect(chart).to_be_visible(timeout=30_000)
            expect(panel.locator("progress.nbaccel-progress")).to_have_count(2, timeout=10_000)  # one bar per rank
            first = chart.get_attribute("src")
            expect(chart).not_to_have_attribute("src", first or "", timeout=15_000)  # redrawn with newer records
            expect(cell.locator(".jp-InputPrompt")).to_have_text(re.compile(r"\[\*\]"))  # still running
            assert chart.evaluate("img => img.naturalWidth") > 100
            panel.screenshot(path=str(ARTIFACTS / "live_chart_running.png"))
            expect(cell.locator(".jp-InputPrompt")).to_have_text(re.compile(r"\[\d+\]"), timeout=90_000)
            expect(panel.locator(".nbaccel-ranks")).to_contain_text("100/100")
        except BaseException:
            page.screenshot(path=str(ARTIFACTS / "browser_failure.png"), full_page=True)
            raise
        finally:
            browser.close()


LONG_LINE = ("%%accel_launch -n 2\n"
             "import os\n"
             "print('rank', os.environ['RANK'], 'says', 'x' * 300, 'END', flush=True)\n")


@pytest.mark.parametrize("lab", [{"cells": ["%load_ext nbaccel", LONG_LINE]}], indirect=True)
def test_a_300_character_last_line_is_cut_with_an_ellipsis_not_pushed_off_the_edge(lab):
    from playwright.sync_api import expect, sync_playwright

    url, _, _ = lab
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1000, "height": 900})
        try:
            page.goto(url)
            page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=60_000)
            expect(page.get_by_text("Python 3 (ipykernel) | Idle")).to_be_visible(timeout=60_000)
            _run_cell(page, 0)
            _run_cell(page, 1, wait_ms=120_000)
            cell = page.locator(".jp-Notebook .jp-Cell").nth(1)
            panel = cell.locator(".nbaccel-status")
            expect(panel).to_contain_text("finished", timeout=30_000)
            last = panel.locator(".nbaccel-last-line").first
            expect(last).to_have_attribute("title", "rank 0 says " + "x" * 300 + " END")  # the full text on hover
            for box in (panel, cell.locator(".jp-OutputArea-output").last, panel.locator(".nbaccel-ranks")):
                sizes = box.evaluate("e => [e.scrollWidth, e.clientWidth]")
                assert sizes[0] <= sizes[1], sizes  # nothing pushed off the right edge
            assert last.evaluate("e => e.scrollWidth > e.clientWidth")  # cut, with CSS's ellipsis
            assert last.evaluate("e => getComputedStyle(e).textOverflow") == "ellipsis"
            for label in panel.locator(".nbaccel-rank-label").all():
                assert label.evaluate("e => e.getClientRects().length") == 1  # "rank 0" on one line
            panel.screenshot(path=str(ARTIFACTS / "status_panel_long_line.png"))
        except BaseException:
            page.screenshot(path=str(ARTIFACTS / "browser_failure.png"), full_page=True)
            raise
        finally:
            browser.close()
