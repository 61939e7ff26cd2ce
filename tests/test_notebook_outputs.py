"""Committed notebooks carry no outputs; JupyterLab (`make lab`) saves them without outputs, so running
one leaves `git status` clean; git's clean filter keeps outputs saved by other editors out of diffs
and commits."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _strip(text: str) -> str:
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "nbstrip.py")], input=text.encode(),
                         capture_output=True, timeout=60, check=True)
    return out.stdout.decode()


def _as_if_run(text: str) -> str:
    notebook = json.loads(text)
    for number, cell in enumerate(c for c in notebook["cells"] if c["cell_type"] == "code"):
        cell["execution_count"] = number + 1
        cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": ["ran\n"]}]
        cell["metadata"]["execution"] = {"iopub.execute_input": "2026-01-01T00:00:00Z"}
    notebook["metadata"]["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    # what a plain save in JupyterLab changes: the kernel's own display name (its language_info, the same
    # as the committed one on Python 3.11, stays)
    notebook["metadata"]["kernelspec"]["display_name"] = "Python 3"
    return json.dumps(notebook, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebooks_have_no_outputs_and_pass_the_filter_unchanged(path):
    text = path.read_text(encoding="utf-8")
    notebook = json.loads(text)
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None, "commit notebooks without outputs"
    assert _strip(text) == text, "not in Jupyter's layout: run it through tools/nbstrip.py once"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_the_filter_removes_what_a_run_and_a_save_add(path):
    text = path.read_text(encoding="utf-8")
    assert _as_if_run(text) != text and _strip(_as_if_run(text)) == text


def test_every_committed_cell_has_an_id_so_jupyterlab_invents_none():
    for path in NOTEBOOKS:
        notebook = json.loads(path.read_text(encoding="utf-8"))
        assert (notebook["nbformat"], notebook["nbformat_minor"]) >= (4, 5), path.name
        ids = [cell.get("id") for cell in notebook["cells"]]
        assert None not in ids and len(set(ids)) == len(ids), f"{path.name}: every cell needs its own id"


def test_git_never_records_outputs_saved_by_other_editors(tmp_path):
    if shutil.which("git") is None:
        pytest.fail("git is needed for this test")
    repo = tmp_path / "clone"
    (repo / "notebooks").mkdir(parents=True)
    (repo / "tools").mkdir()
    shutil.copy(ROOT / ".gitattributes", repo)
    shutil.copy(ROOT / "tools" / "nbstrip.py", repo / "tools")
    shutil.copy(NOTEBOOKS[0], repo / "notebooks")
    git = lambda *args, cwd=repo: subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,  # noqa: E731
                                                 timeout=60, check=True).stdout
    git("init", "-q")
    git("config", "user.email", "test@example.com")
    git("config", "user.name", "test")
    # What `make notebook-filter` configures (PYTHON is python3 there; this interpreter here).
    make = subprocess.run(["make", "-n", "-B", "notebook-filter", f"PYTHON={sys.executable}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert f'git config filter.carlskit-nbstrip.clean "{sys.executable} tools/nbstrip.py"' in make.stdout
    git("config", "filter.carlskit-nbstrip.clean", f"{sys.executable} tools/nbstrip.py")
    git("add", ".")
    git("commit", "-qm", "notebooks")
    notebook = repo / "notebooks" / NOTEBOOKS[0].name
    notebook.write_text(_as_if_run(notebook.read_text(encoding="utf-8")), encoding="utf-8")
    # git status compares sizes first and may list the file until the index is refreshed; content is what counts:
    assert git("diff") == "" and git("diff", cwd=repo / "notebooks") == ""
    git("add", "-A")
    assert git("status", "--porcelain") == "", "nothing to commit: the outputs never reach git"
    assert '"ran' in notebook.read_text(), "the working copy keeps its outputs"
    text = json.loads(notebook.read_text())
    text["cells"][0]["source"] = ["# changed\n"]
    notebook.write_text(json.dumps(text, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    assert git("status", "--porcelain").strip() == f"M notebooks/{NOTEBOOKS[0].name}", "a source edit still shows"


def test_jupyterlab_saves_notebooks_without_outputs_and_keeps_a_copy_with_them(tmp_path):
    import nbformat
    from jupyter_server.services.contents.filemanager import FileContentsManager
    from traitlets.config import Config, PyFileConfigLoader

    assert "--config=$(CURDIR)/tools/jupyter_server_config.py" in (ROOT / "Makefile").read_text()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the lab's log stays free of warnings about our hook
        loader = PyFileConfigLoader("jupyter_server_config.py", path=str(ROOT / "tools"))
        config = loader.load_config()
        manager = FileContentsManager(root_dir=str(tmp_path), config=Config(config))
    committed = NOTEBOOKS[0].read_text(encoding="utf-8")
    run = nbformat.reads(_as_if_run(committed), as_version=4)
    manager.save({"type": "notebook", "format": "json", "content": run}, "00.ipynb")
    saved = (tmp_path / "00.ipynb").read_text(encoding="utf-8")
    assert saved == committed, "saved byte for byte as committed (git trusts a size change without filtering)"
    executed = nbformat.read(tmp_path / "executed" / "00.ipynb", as_version=4)
    assert any(cell.get("outputs") for cell in executed.cells), "the copy keeps the outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_what_jupyter_writes_for_a_committed_notebook_is_the_committed_notebook(path):
    """JupyterLab's save: nbformat writes the notebook (a source as its list of lines), then make lab's
    pre-save hook strips it (tools/jupyter_server_config.py); the bytes must come back unchanged
    (04 once stored sources as single strings: every save rewrote it)."""
    import nbformat

    text = path.read_text(encoding="utf-8")
    written = nbformat.writes(nbformat.reads(text, as_version=4)) + "\n"
    assert _strip(written) == text


def test_starting_a_kernel_leaves_a_notebook_saved_by_jupyterlab_unmodified(tmp_path):
    """A kernel writes its ``language_info`` into the notebook at every start; JupyterLab marks the
    notebook modified unless the value equals what the file holds (its JSON deep-equal check). The
    committed notebooks hold the block a Python 3.11 kernel writes, and both the save hook and git's
    filter keep it: a kernel start changes nothing, and the saved file is what git stores."""
    import jupyter_client
    import nbformat
    from jupyter_server.services.contents.filemanager import FileContentsManager
    from traitlets.config import Config, PyFileConfigLoader

    manager, kernel = jupyter_client.manager.start_new_kernel(kernel_name="python3")
    try:
        language_info = kernel.kernel_info(reply=True, timeout=60)["content"]["language_info"]
    finally:
        kernel.stop_channels()
        manager.shutdown_kernel(now=True)
    config = PyFileConfigLoader("jupyter_server_config.py", path=str(ROOT / "tools")).load_config()
    contents = FileContentsManager(root_dir=str(tmp_path), config=Config(config))
    committed = NOTEBOOKS[0].read_text(encoding="utf-8")
    opened = nbformat.reads(committed, as_version=4)
    opened.metadata["language_info"] = language_info  # what JupyterLab's model holds once the kernel started
    contents.save({"type": "notebook", "format": "json", "content": opened}, "00.ipynb")
    saved = json.loads((tmp_path / "00.ipynb").read_text(encoding="utf-8"))
    assert saved["metadata"].get("language_info") == language_info, "the next kernel start would modify it"
    committed_info = json.loads(committed)["metadata"]["language_info"]
    # the same block but the interpreter's patch version (another Python marks notebooks modified: nbstrip.py)
    assert {k: v for k, v in committed_info.items() if k != "version"} == \
        {k: v for k, v in language_info.items() if k != "version"}
    if language_info["version"] == committed_info["version"]:
        assert (tmp_path / "00.ipynb").read_text(encoding="utf-8") == committed, "saved as git stores it"
