"""A real browser: JupyterLab on 127.0.0.1, headless Chromium driven by Playwright, running a notebook
whose background thread trains a model while ``LiveSummaries`` redraws its plot.

Needs Debian's ``chromium`` at /usr/bin/chromium and the ``playwright`` package (its own browser
downloads are not used). Without them the test skips locally and fails in CI (env ``CI`` set).
"""

from __future__ import annotations

import hashlib
import shutil
import time
from pathlib import Path

import pytest
from lab_session import REPO_ROOT, chromium, open_notebook, require_browser_tools, run_all_cells, running_lab

NOTEBOOK = Path(__file__).with_name("live_training.ipynb")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leftover_processes")]


@pytest.fixture
def jupyter_lab(tmp_path):
    """A JupyterLab server on a free port of 127.0.0.1 serving a copy of the notebook."""
    require_browser_tools()  # before JupyterLab starts: a skip locally, a failure in CI
    root = tmp_path / "notebooks"
    root.mkdir()
    shutil.copy(NOTEBOOK, root / NOTEBOOK.name)
    with running_lab(root, tmp_path / "jupyter") as lab:
        yield lab.url(NOTEBOOK.name)


def element_digest(locator) -> str:
    return hashlib.sha256(locator.screenshot()).hexdigest()


def test_live_summaries_render_and_update_in_a_real_browser(jupyter_lab, tmp_path):
    screenshot = tmp_path / "live_summaries.png"
    with chromium() as browser:
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            open_notebook(page, jupyter_lab)
            run_all_cells(page)

            image = page.locator(".jp-OutputArea-output img.widget-image").first
            image.wait_for(state="visible", timeout=60_000)
            page.wait_for_function(
                "() => { const i = document.querySelector('.jp-OutputArea-output img.widget-image');"
                " return i && i.complete && i.naturalWidth > 100; }", timeout=60_000)
            assert page.locator(".jp-OutputArea-output .widget-toggle-button").count() == 1  # pause
            first_digest, first_source = element_digest(image), image.get_attribute("src")
            digests = {first_digest}
            deadline = time.monotonic() + 60
            while len(digests) < 3 and time.monotonic() < deadline:  # the plot keeps changing
                page.wait_for_timeout(700)
                digests.add(element_digest(image))
            image.scroll_into_view_if_needed()
            page.screenshot(path=str(screenshot), full_page=True)
            assert len(digests) >= 3, "the live plot did not change while the model trained"
            assert image.get_attribute("src") != first_source
            errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
            assert errors.count() == 0, errors.first.inner_text()
        finally:
            if not screenshot.exists():  # keep evidence of a failure too
                for page in browser.contexts[0].pages if browser.contexts else []:
                    page.screenshot(path=str(screenshot), full_page=True)
    if screenshot.exists():
        output = REPO_ROOT / "test-output"
        output.mkdir(exist_ok=True)
        shutil.copy(screenshot, output / screenshot.name)
    assert screenshot.exists() and screenshot.stat().st_size > 10_000

