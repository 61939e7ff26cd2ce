"""What a saved notebook (an executed copy in ``notebooks/executed/``) must show a reader: checked on
every notebook run by ``make test`` (the repository's ``conftest.py`` for nbmake,
``tests/notebooks/test_run_all_in_lab.py`` for JupyterLab)."""

from __future__ import annotations

import re

_WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
_WIDGET_REPR = re.compile(r"^\w+\((children|value|layout|description)=")  # ipywidgets' own repr
_PYTHON_WARNING = re.compile(r"\b\w*Warning: ")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STDERR = "application/vnd.jupyter.stderr"  # how JupyterLab marks error and stderr outputs


def unseen_outputs(notebook) -> list[str]:
    """Cells whose saved outputs show nothing a reader can see in place of a widget, or print a warning."""
    problems = []
    for index, cell in enumerate(notebook.cells):
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if _WIDGET_VIEW in data and not ({"text/html", "image/png"} & set(data)):
                text = "".join(data.get("text/plain", ""))
                if not text.strip() or _WIDGET_REPR.match(text):
                    problems.append(f"cell {index}: a widget with no static frame ({text[:40]!r})")
            if output.get("output_type") == "stream" and _PYTHON_WARNING.search("".join(output.get("text", ""))):
                problems.append(f"cell {index}: a warning: {''.join(output['text'])[:200]!r}")
    return problems


def page_problems(state: dict, notebook) -> list[str]:
    """What JupyterLab's page showed after Run All (``state["cells"]``: per code cell, its outputs' MIME types
    and text, and whether a widget view is drawn): an error or stderr output, a widget error message, and a
    cell whose saved outputs hold a widget view while the page draws none (closed, or never rendered)."""
    problems = []
    code_cells = [(index, cell) for index, cell in enumerate(notebook.cells) if cell.cell_type == "code"]
    for (index, cell), shown in zip(code_cells, state["cells"], strict=True):
        where = f"cell {index} (page)"
        for output in shown["outputs"]:
            if output["mime"] == _STDERR:
                problems.append(f"{where}: error or stderr output: {output['text'][:1500]}")
            if re.search(r"Error displaying widget|model not found", output["text"]):
                problems.append(f"{where}: {output['text'][:200]!r}")
        saved_widget = any(_WIDGET_VIEW in output.get("data", {}) for output in cell.get("outputs", []))
        if saved_widget and not shown["widget_shown"]:
            problems.append(f"{where}: its widget is not drawn (closed, or never rendered)")
    return problems


def saved_problems(notebook) -> list[str]:
    """A saved copy after Run All: a code cell that never ran, an error (with its traceback) or stderr output
    (a warning included), and :func:`unseen_outputs`."""
    problems = []
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code":
            continue
        if cell.get("execution_count") is None and cell.source.strip():
            problems.append(f"cell {index} never ran (Run All stopped before it)")
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                trace = _ANSI.sub("", "\n".join(output.get("traceback", [])))
                problems.append(f"cell {index}: {output['ename']}: {output['evalue']}\n{trace[-3000:]}")
            elif output.get("output_type") == "stream" and output.get("name") == "stderr":
                problems.append(f"cell {index}: stderr: {''.join(output['text'])[:1500]!r}")
    return problems + unseen_outputs(notebook)
