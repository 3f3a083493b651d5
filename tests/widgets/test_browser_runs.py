"""A background run in a real browser: another cell runs meanwhile, and after a page reload
``%accel_runs show`` brings the live view back, with what was printed while the page was away.

JupyterLab driven through Chromium, as in ``test_browser.py`` (skipped without them).
"""

from __future__ import annotations

import re
import time

import pytest

from .test_browser import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, _run_cell, lab  # noqa: F401 - lab: a fixture

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]

BACKGROUND = ("%%accel_launch --background run -n 2 --cpu\n"
              "import time\n"
              "for i in range(60):\n"
              "    print('tick', i, flush=True)\n"
              "    time.sleep(0.25)\n"
              "'trained'\n")
CELLS = ["%load_ext nbaccel", BACKGROUND, "print('another cell ran', 6 * 7)", "%accel_runs show", "run.result()"]


def _last_tick(text: str) -> int:
    ticks = [int(n) for n in re.findall(r"\[rank0\]: tick (\d+)", text)]
    return max(ticks) if ticks else -1


@pytest.mark.parametrize("lab", [{"cells": CELLS}], indirect=True)
def test_a_background_run_is_shown_again_after_a_reload_and_finishes_there(lab):  # noqa: F811 - the imported fixture
    from playwright.sync_api import expect, sync_playwright

    url, _, _ = lab
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1280, "height": 1200})
        page.on("dialog", lambda dialog: dialog.accept())  # "leave the page?" on reload
        try:
            page.goto(url)
            page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=60_000)
            expect(page.get_by_text("Python 3 (ipykernel) | Idle")).to_be_visible(timeout=60_000)
            _run_cell(page, 0)
            _run_cell(page, 1, wait_ms=30_000)  # the cell ends at once: the ranks go on
            cells = page.locator(".jp-Notebook .jp-Cell")
            launched = cells.nth(1)
            expect(launched.locator(".nbaccel-status")).to_contain_text("running", timeout=30_000)
            expect(launched.locator(".nbaccel-run-output")).to_contain_text("[rank0]: tick 2", timeout=30_000)
            _run_cell(page, 2)
            expect(cells.nth(2).locator(".jp-OutputArea-output")).to_have_text("another cell ran 42")
            seen = _last_tick(launched.locator(".nbaccel-run-output").inner_text())
            expect(launched.locator(".nbaccel-status")).to_contain_text("running")

            page.reload()
            page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=60_000)
            time.sleep(2)  # the ranks print on while the page is away
            expect(page.locator(".nbaccel-run-output")).to_have_count(0)  # the old view is gone with the page
            _run_cell(page, 3)
            shown = page.locator(".jp-Notebook .jp-Cell").nth(3)
            view = shown.locator(".nbaccel-run-output")
            expect(view).to_contain_text("[rank1]: tick 0", timeout=30_000)  # from the start of the run
            assert _last_tick(view.inner_text()) > seen + 4, (seen, view.inner_text()[-300:])  # printed while away
            expect(shown.locator(".nbaccel-status")).to_contain_text("running")
            shown.screenshot(path=str(ARTIFACTS / "background_run_shown_again.png"))
            expect(view).to_contain_text("[rank1]: tick 59", timeout=60_000)  # live: it goes on there
            expect(shown.locator(".nbaccel-status")).to_contain_text("finished", timeout=30_000)
            _run_cell(page, 4)
            result = page.locator(".jp-Notebook .jp-Cell").nth(4).locator(".jp-OutputArea-executeResult")
            expect(result).to_contain_text("'trained'")
        except BaseException:
            page.screenshot(path=str(ARTIFACTS / "browser_failure.png"), full_page=True)
            raise
        finally:
            browser.close()
