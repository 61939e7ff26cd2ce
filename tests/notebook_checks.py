"""What a saved notebook (an executed copy in ``notebooks/executed/``) must show a reader: checked on
every notebook run by ``make test`` (the repository's ``conftest.py`` for nbmake,
``tests/notebooks/test_run_all_in_lab.py`` for JupyterLab)."""

from __future__ import annotations

import re

_WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
_WIDGET_REPR = re.compile(r"^\w+\((children|value|layout|description)=")  # ipywidgets' own repr
_PYTHON_WARNING = re.compile(r"\b\w*Warning: ")


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
