"""Every tutorial as a user runs it: ``make lab``'s JupyterLab (the same server config) serving the
checkout's ``notebooks/``, headless Chromium opening each notebook, Run All Cells (``CARLSKIT_SMALL=1``
in the kernel's environment), waiting for the kernel, saving with Ctrl+S. Then:

- no error output and no stderr output (a warning included) in the page or the saved copy, and every
  code cell ran (an error stops Run All: the test shows the traceback);
- every widget output is rendered in the page (a visible box, not "Error displaying widget"), and the
  copy saved with outputs (``notebooks/executed/NAME.ipynb``, what ``make docs`` renders) shows a
  static frame for each (``notebook_checks.unseen_outputs``, the check every notebook run gets);
- the save leaves the notebook's bytes (the kernel's ``language_info`` included: ``tools/nbstrip.py``)
  and ``git status`` as they were (the README's promise).

The kernels see the same ``$IPYTHONDIR`` as nbmake's (the repository's ``conftest.py``), so every table a
notebook displays is checked here too. Chromium missing: a skip locally, a failure in CI.
"""

from __future__ import annotations

import difflib
import os
import subprocess
import time

import nbformat
import pytest
from lab_session import (
    NOTEBOOK_PANEL,
    REPO_ROOT,
    chromium,
    open_notebook,
    require_browser_tools,
    run_all_cells,
    running_lab,
)
from notebook_checks import page_problems, saved_problems

NOTEBOOKS = REPO_ROOT / "notebooks"
EXECUTED = NOTEBOOKS / "executed"
NAMES = sorted(path.name for path in NOTEBOOKS.glob("*.ipynb"))
RUN_SECONDS = 300  # one notebook's Run All at small size (nbmake's --nbmake-timeout in make test)

# Chromium starts helper processes per page, so the per-test process check is the lab's own: after each
# notebook its kernel and whatever the kernel started (Dask workers) are gone (Lab.shut_down_kernels).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(RUN_SECONDS + 120)]

# What the page shows once Run All is over: per code cell its prompt, whether a widget view in its outputs is
# drawn (a box of at least 1 px; a closed widget leaves an empty, hidden output), and its outputs' MIME type and text.
PAGE_STATE = """(PANEL) => {
  const cells = [...document.querySelectorAll(PANEL + ' .jp-CodeCell')];
  return {
    idle: document.body.innerText.includes('(ipykernel) | Idle'),
    cells: cells.map(c => ({
      prompt: (c.querySelector('.jp-InputArea-prompt') || {}).innerText || '',
      widget_shown: [...c.querySelectorAll('.jp-OutputArea-output .jupyter-widgets')].some(v => {
        const box = v.getBoundingClientRect(); return box.width >= 1 && box.height >= 1; }),
      outputs: [...c.querySelectorAll('.jp-OutputArea-output')].map(o => (
        {mime: o.dataset.mimeType || '', text: o.innerText.slice(0, 2000)})),
    })),
  };
}"""


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """``make lab``'s server (tools/jupyter_server_config.py) on the checkout's notebooks, small problem sizes."""
    require_browser_tools()
    env = dict(os.environ, CARLSKIT_SMALL="1")
    config = f"--config={REPO_ROOT / 'tools' / 'jupyter_server_config.py'}"
    with running_lab(NOTEBOOKS, tmp_path_factory.mktemp("lab"), extra_args=[config], env=env) as server:
        yield server


@pytest.fixture(scope="module")
def browser(lab):
    with chromium() as browser:
        yield browser


def git_status(path) -> str:
    return subprocess.run(["git", "status", "--porcelain", "--", str(path)], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=60, check=True).stdout


def wait_until_run_all_is_over(page, seconds: float) -> dict:
    """Poll until no cell is queued or running and the kernel is idle, twice in a row (a cell can start
    an instant after the previous one ends)."""
    deadline, quiet = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        state = page.evaluate(PAGE_STATE, NOTEBOOK_PANEL)
        busy = any("*" in cell["prompt"] for cell in state["cells"])
        quiet = quiet + 1 if state["idle"] and not busy else 0
        if quiet >= 2:
            return state
        page.wait_for_timeout(500)
    prompts = [cell["prompt"] for cell in state["cells"]]
    raise AssertionError(f"Run All did not finish within {seconds:.0f} s; prompts: {prompts}")


def save(page, executed) -> None:
    """Ctrl+S, then wait until the copy with outputs is written (again: JupyterLab's autosave may have written
    one during the run) and the tab is no longer marked dirty."""
    since = time.time()
    page.locator(f"{NOTEBOOK_PANEL} .jp-Notebook").first.click(position={"x": 5, "y": 5})
    page.keyboard.press("Escape")  # command mode: Ctrl+S saves in either mode, a click may have entered edit mode
    page.keyboard.press("Control+s")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        written = executed.is_file() and executed.stat().st_mtime >= since
        if written and page.locator(".lm-TabBar-tab.jp-mod-dirty").count() == 0:
            return
        page.wait_for_timeout(250)
    raise AssertionError(f"saving did not write {executed.relative_to(REPO_ROOT)} within 60 s")


@pytest.mark.parametrize("name", NAMES)
def test_run_all_in_jupyterlab_shows_every_result_and_saving_leaves_git_clean(lab, browser, name):
    path, executed = NOTEBOOKS / name, EXECUTED / name
    committed, status = path.read_bytes(), git_status(path)
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    try:
        open_notebook(page, lab.url(name))
        run_all_cells(page)
        state = wait_until_run_all_is_over(page, RUN_SECONDS)
        save(page, executed)
    finally:
        page.close()
        leftovers = lab.shut_down_kernels()
    assert not leftovers, f"{name}: processes left running after its kernel shut down: {leftovers}"
    notebook = nbformat.read(executed, as_version=4)
    problems = page_problems(state, notebook) + saved_problems(notebook)
    saved = path.read_bytes()
    if saved != committed:
        restore = path.with_name(f".{path.name}.restore")
        restore.write_bytes(committed)
        os.replace(restore, path)  # the checkout as it was; the test still fails
        diff = difflib.unified_diff(committed.decode().splitlines(), saved.decode().splitlines(), lineterm="", n=1)
        problems.append("a plain save changed the notebook:\n" + "\n".join(list(diff)[:40]))
    elif git_status(path) != status:
        problems.append(f"git status changed after the save: {status!r} -> {git_status(path)!r}")
    assert not problems, f"{name} in JupyterLab:\n" + "\n".join(problems)
