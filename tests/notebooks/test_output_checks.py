"""The checks every notebook run applies (``tests/notebook_checks.py``) flag each kind of problem and
pass a clean run: hand-built saved copies and page states, no browser. The page states are what
JupyterLab 4 shows (checked by running bad notebooks through test_run_all_in_lab.py): errors and
warnings as ``application/vnd.jupyter.stderr`` outputs, a closed widget as a hidden, empty output."""

from __future__ import annotations

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output
from notebook_checks import page_problems, saved_problems

WIDGET = {"application/vnd.jupyter.widget-view+json": {"model_id": "m", "version_major": 2, "version_minor": 0}}


def run(*cells):
    """A saved copy after Run All: every code cell numbered, outputs as given."""
    built = [new_markdown_cell("# title")]
    for number, outputs in enumerate(cells, start=1):
        built.append(new_code_cell("x = 1", execution_count=number, outputs=list(outputs)))
    return new_notebook(cells=built)


def page(*cells):
    """JupyterLab's page state: per code cell (outputs' MIME and text, widget drawn)."""
    return {"idle": True, "cells": [{"prompt": "[1]:", "widget_shown": shown, "outputs": outputs}
                                    for outputs, shown in cells]}


def frame(text="", png=False):
    data = dict(WIDGET, **{"text/plain": text})
    if png:
        data["image/png"] = "iVBORw0KGgo="
    return new_output("display_data", data=data)


def test_a_clean_run_passes_both_checks():
    notebook = run([new_output("stream", name="stdout", text="loss 0.1\n")], [frame("plot", png=True)])
    assert saved_problems(notebook) == []
    assert page_problems(page(([{"mime": "text/plain", "text": "loss 0.1"}], False),
                              ([{"mime": "", "text": ""}], True)), notebook) == []


def test_an_error_shows_its_traceback_and_the_cells_run_all_never_reached():
    notebook = run([new_output("error", ename="ZeroDivisionError", evalue="division by zero",
                               traceback=["\x1b[0;31mZeroDivisionError\x1b[0m", "----> 1 1/0"])])
    notebook.cells.append(new_code_cell("y = 2"))
    problems = saved_problems(notebook)
    assert "cell 1: ZeroDivisionError: division by zero" in problems[0] and "----> 1 1/0" in problems[0]
    assert "\x1b" not in problems[0]
    assert problems[1] == "cell 2 never ran (Run All stopped before it)"


def test_a_warning_or_any_stderr_output_fails():
    warned = run([new_output("stream", name="stderr", text="/x.py:2: UserWarning: careful\n")])
    assert any("UserWarning: careful" in problem and "stderr" in problem for problem in saved_problems(warned))
    assert any("a warning" in problem for problem in saved_problems(warned))
    stderr = run([new_output("stream", name="stderr", text="progress 3/5\n")])
    assert saved_problems(stderr) == ["cell 1: stderr: 'progress 3/5\\n'"]
    shown = page(([{"mime": "application/vnd.jupyter.stderr", "text": "UserWarning: careful"}], False))
    assert page_problems(shown, run([])) == ["cell 1 (page): error or stderr output: UserWarning: careful"]


def test_a_widget_without_a_static_frame_or_not_drawn_on_the_page_fails():
    bare = run([frame("IntSlider(value=0)")])
    assert saved_problems(bare) == ["cell 1: a widget with no static frame ('IntSlider(value=0)')"]
    saved = run([frame("plot", png=True)])
    closed = page(([{"mime": "", "text": ""}], False))  # what a closed widget leaves: a hidden, empty output
    assert page_problems(closed, saved) == ["cell 1 (page): its widget is not drawn (closed, or never rendered)"]
    broken = page(([{"mime": "", "text": "Error displaying widget: model not found"}], True))
    assert len(page_problems(broken, saved)) == 1


def test_the_page_and_the_saved_copy_must_have_the_same_code_cells():
    with pytest.raises(ValueError):  # a page with fewer code cells than the saved copy
        page_problems(page(([], False)), run([], []))


def test_nbformat_round_trip_keeps_what_the_checks_read(tmp_path):
    notebook = run([new_output("error", ename="E", evalue="v", traceback=["t"])])
    nbformat.write(notebook, tmp_path / "n.ipynb")
    assert saved_problems(nbformat.read(tmp_path / "n.ipynb", as_version=4)) == saved_problems(notebook)
