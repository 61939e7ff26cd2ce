"""The first notebook a new user runs ends cleanly: the quickstart, executed as ``make test`` runs it
(``CARLSKIT_SMALL=1``), prints no ``ERROR`` and no ``Traceback``: not in a cell, not on the kernel's
stderr (what its embedded cluster's worker processes log goes to one or the other)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "notebooks" / "00_quickstart.ipynb"


def test_the_quickstart_runs_to_its_last_cell_without_an_error_or_traceback(tmp_path):
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, CARLSKIT_SMALL="1", PYTHONPATH=path)
    run = subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
                          "--ExecutePreprocessor.timeout=600", "--output-dir", str(tmp_path), str(QUICKSTART)],
                         cwd=QUICKSTART.parent, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    notebook = nbformat.read(tmp_path / QUICKSTART.name, as_version=4)
    printed = [run.stderr]
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            printed.append(output.get("text", "") + output.get("ename", "") + "".join(output.get("traceback", [])))
    alarming = [text for text in printed if "ERROR" in text or "Traceback" in text]
    assert not alarming, "\n".join(alarming)[-4000:]
    assert "client status: closed" in "".join(printed)
