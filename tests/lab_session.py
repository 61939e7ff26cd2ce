"""A real JupyterLab for browser tests: the server on a free port of 127.0.0.1, headless Debian Chromium
driven by Playwright (its own browser downloads are never used). Shared by the widget test
(``tests/widgets/test_browser.py``) and the Run All of every tutorial (``tests/notebooks/test_run_all_in_lab.py``).

Without ``/usr/bin/chromium`` or the ``playwright`` package a test that needs them skips locally and
fails in CI (env ``CI`` set): ``make browser`` installs Chromium.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import psutil
import pytest
from process_helpers import wait_for_no_children

try:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright
except ImportError:  # reported by the test itself: a skip locally, a failure in CI
    PlaywrightTimeout = sync_playwright = None

REPO_ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]

# Start the notebook's kernel on open (no kernel dialog) and fetch no news (no network). Every cell stays
# in the DOM (JupyterLab 4 otherwise leaves cells outside the viewport unrendered), so a test sees them all.
USER_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker": {"autoStartDefaultKernel": True, "windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
}


# The notebook panel on show (a hidden one may stay in the DOM).
NOTEBOOK_PANEL = ".jp-NotebookPanel:not(.lm-mod-hidden)"


def require(condition: bool, reason: str) -> None:
    """A missing browser tool: a skip locally, a failure in CI."""
    if condition:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set, so this is a failure: install it in the Makefile/.ci/run)")
    pytest.skip(reason)


def require_browser_tools() -> None:
    require(CHROMIUM.exists(), f"{CHROMIUM} is absent (Debian package 'chromium'; make browser installs it)")
    require(sync_playwright is not None, "the 'playwright' Python package is not installed")


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


class Lab:
    """A running JupyterLab: ``url(path)`` opens a file, ``api(method, path)`` calls its REST API."""

    def __init__(self, base: str, token: str, log: Path, pid: int):
        self.base, self.token, self.log, self.pid = base, token, log, pid

    def url(self, path: str) -> str:
        """The page with ``path`` open alone (``reset``: no tabs restored from an earlier page's workspace)."""
        return f"{self.base}/lab/tree/{path}?token={self.token}&reset"

    def api(self, method: str, path: str):
        request = urllib.request.Request(f"{self.base}/api/{path}", method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            body = response.read()
        return json.loads(body) if body else None

    def shut_down_kernels(self, seconds: float = 30.0) -> list[str]:
        """Shut every kernel down and wait until the server has no child process left (a kernel, or a
        process a kernel started); return the command lines of those still alive after ``seconds``
        (killed)."""
        for kernel in self.api("GET", "kernels"):
            with contextlib.suppress(OSError):
                self.api("DELETE", f"kernels/{kernel['id']}")
        alive = wait_for_no_children(set(), seconds, parent=psutil.Process(self.pid))
        leftovers = []
        for child in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                leftovers.append(" ".join(child.cmdline()[:4]))
                child.kill()
        return leftovers


@contextlib.contextmanager
def running_lab(root: Path, home: Path, *, extra_args=(), env=None):
    """JupyterLab serving ``root``, with private settings/runtime folders under ``home`` (no user state
    touched); stopped (with its kernels: JupyterLab shuts them down on SIGTERM) on exit."""
    for plugin, settings in USER_SETTINGS.items():
        path = home / "settings" / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(settings))
    environment = dict(
        os.environ if env is None else env,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        JUPYTER_RUNTIME_DIR=str(home / "runtime"),
        JUPYTERLAB_SETTINGS_DIR=str(home / "settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"),
    )
    port, token = free_port(), uuid.uuid4().hex
    command = [
        sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}", "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate", *extra_args,
    ]
    if os.getuid() == 0:
        command.append("--allow-root")
    log_path = home / "jupyter-lab.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        server = subprocess.Popen(command, env=environment, stdout=log, stderr=subprocess.STDOUT, cwd=root)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_for_server(f"{base}/api/status?token={token}", server, seconds=60)
            yield Lab(base, token, log_path, server.pid)
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


@contextlib.contextmanager
def chromium():
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def open_notebook(page, url: str) -> None:
    """Open a notebook and wait until its auto-started kernel is connected and idle."""
    page.goto(url)
    page.wait_for_selector(f"{NOTEBOOK_PANEL} .jp-Cell", timeout=60_000)
    page.wait_for_function("() => document.body.innerText.includes('(ipykernel) | Idle')", timeout=90_000)


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
