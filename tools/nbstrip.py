"""Git clean filter for notebooks: what git stores is the notebook without its outputs.

Configured by ``make lab`` / ``make test`` (``git config filter.carlskit-nbstrip.clean ...``) for
the files ``.gitattributes`` names. Running a notebook then leaves ``git status`` clean: outputs stay
in your working copy (JupyterLab shows them), while git compares and commits the sources only.
Reads a notebook on stdin, writes it on stdout with every code cell's outputs and execution count
cleared and run-specific metadata (execution timings, widget state) dropped, in the layout Jupyter
itself writes (sorted keys, one-space indent, trailing newline), so a committed notebook passes
through unchanged. What a plain save in JupyterLab adds to an unchanged notebook is normalised too:
a cell's source as one string (Jupyter writes its list of lines), the kernel's display name
(``Python 3`` or ``Python 3 (ipykernel)``: one name) and a cell id for a cell that has none
(JupyterLab invents a random one). Standard library only: git runs it with any Python 3.

The kernel's ``language_info`` block is kept, and committed (as Python 3.11's kernel writes it): a
kernel start then sets the value the file already holds, so an opened notebook stays unmodified
(dropping it made every opened notebook ask "save changes?" on close; issue 44). It cannot be dropped
in git's filter only: git trusts a file whose size differs from the checked-out one to be modified
without running the filter, so the file JupyterLab saves must be byte for byte what git stores. A
kernel of another Python version writes its own version there: that notebook shows as modified.
"""

from __future__ import annotations

import json
import sys

_VOLATILE_CELL_METADATA = ("execution", "ExecuteTime", "collapsed", "scrolled")
_VOLATILE_NOTEBOOK_METADATA = ("widgets",)
# The kernelspec every committed notebook names (what ipykernel's kernel.json says, so saving keeps it).
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


def strip(notebook: dict) -> dict:
    """Clear outputs and run-specific metadata in place (git's filter and JupyterLab's save alike)."""
    taken = {cell["id"] for cell in notebook.get("cells", []) if "id" in cell}
    for number, cell in enumerate(notebook.get("cells", [])):
        if "id" not in cell and (notebook.get("nbformat"), notebook.get("nbformat_minor", 0)) >= (4, 5):
            # deterministic (the same notebook always gets the same id) and unique within the notebook
            suffix = number
            while f"cell-{suffix}" in taken:
                suffix += len(notebook["cells"])
            cell["id"] = f"cell-{suffix}"
            taken.add(cell["id"])
        if isinstance(cell.get("source"), str):  # Jupyter writes a source as its list of lines (nbformat's split_lines)
            cell["source"] = cell["source"].splitlines(True)
        if cell.get("cell_type") == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
        metadata = cell.get("metadata", {})
        for key in _VOLATILE_CELL_METADATA:
            metadata.pop(key, None)
    metadata = notebook.get("metadata", {})
    for key in _VOLATILE_NOTEBOOK_METADATA:
        metadata.pop(key, None)
    if metadata.get("kernelspec", {}).get("name") == KERNELSPEC["name"]:
        metadata["kernelspec"] = dict(KERNELSPEC)
    return notebook


def dumps(notebook: dict) -> str:
    return json.dumps(notebook, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def main() -> int:
    text = sys.stdin.buffer.read().decode("utf-8")
    try:
        notebook = json.loads(text)
    except ValueError:  # not JSON (a merge conflict, say): store it as it is
        sys.stdout.buffer.write(text.encode("utf-8"))
        return 0
    sys.stdout.buffer.write(dumps(strip(notebook)).encode("utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
