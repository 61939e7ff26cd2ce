"""A real browser: JupyterLab on 127.0.0.1, headless Chromium driven by Playwright, running a notebook
whose background thread trains a model while ``LiveSummaries`` redraws its plot.

Needs Debian's ``chromium`` at /usr/bin/chromium and the ``playwright`` package (its own browser
downloads are not used). Without them the test skips locally and fails in CI (env ``CI`` set).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

try:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright
except ImportError:  # reported by the test itself: a skip locally, a failure in CI
    PlaywrightTimeout = sync_playwright = None

REPO_ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = Path(__file__).with_name("live_training.ipynb")
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]

# Start the notebook's kernel on open (no kernel dialog) and fetch no news (no network).
USER_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker": {"autoStartDefaultKernel": True},
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
}

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leftover_processes")]


def require(condition: bool, reason: str) -> None:
    if condition:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set, so this is a failure: install it in the Makefile/.ci/run)")
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_server(url: str, process: subprocess.Popen, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.25)
    raise TimeoutError(f"JupyterLab did not answer {url} within {seconds} s")


@pytest.fixture
def browser_tools() -> None:
    """Checked before JupyterLab starts: a skip locally, a failure in CI."""
    require(CHROMIUM.exists(), f"{CHROMIUM} is absent (Debian package 'chromium')")
    require(sync_playwright is not None, "the 'playwright' Python package is not installed")


@pytest.fixture
def jupyter_lab(browser_tools, tmp_path):
    """A JupyterLab server on a free port of 127.0.0.1 serving a copy of the notebook."""
    root = tmp_path / "notebooks"
    root.mkdir()
    shutil.copy(NOTEBOOK, root / NOTEBOOK.name)
    port, token = free_port(), uuid.uuid4().hex
    home = tmp_path / "jupyter"
    for plugin, settings in USER_SETTINGS.items():  # a private settings dir: no user state touched
        path = home / "settings" / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(settings))
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        JUPYTER_RUNTIME_DIR=str(home / "runtime"),
        JUPYTERLAB_SETTINGS_DIR=str(home / "settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"),
    )
    command = [
        sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}", "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    if os.getuid() == 0:
        command.append("--allow-root")
    log = open(tmp_path / "jupyter-lab.log", "wb")
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for_server(f"{base}/api/status?token={token}", server, seconds=60)
        yield f"{base}/lab/tree/{NOTEBOOK.name}?token={token}"
    finally:
        server.terminate()  # JupyterLab shuts its kernels down on SIGTERM
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


def run_all_cells(page) -> None:
    """Run > Run All Cells; retried once if no cell started (the menu can be clicked too early)."""
    for _ in range(2):
        page.locator(".lm-MenuBar-item", has_text="Run").first.click()
        page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
        try:
            page.wait_for_function(
                "() => [...document.querySelectorAll('.jp-InputArea-prompt')]"
                ".some(p => /\\[(\\*|\\d+)\\]/.test(p.innerText))", timeout=15_000)
            return
        except PlaywrightTimeout:
            page.keyboard.press("Escape")
    raise AssertionError("Run All Cells did not start any cell")


def element_digest(locator) -> str:
    return hashlib.sha256(locator.screenshot()).hexdigest()


def test_live_summaries_render_and_update_in_a_real_browser(jupyter_lab, tmp_path):
    screenshot = tmp_path / "live_summaries.png"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.goto(jupyter_lab)
            page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=60_000)
            # The kernel (auto-started by the settings above) must be connected before running.
            page.wait_for_function(
                "() => document.body.innerText.includes('(ipykernel) | Idle')", timeout=60_000)
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
            browser.close()
    if screenshot.exists():
        output = REPO_ROOT / "test-output"
        output.mkdir(exist_ok=True)
        shutil.copy(screenshot, output / screenshot.name)
    assert screenshot.exists() and screenshot.stat().st_size > 10_000

