"""Git clean filter for notebooks: what git stores is the notebook without its outputs.

Configured by ``make lab`` / ``make test`` (``git config filter.carlskit-nbstrip.clean ...``) for
the files ``.gitattributes`` names. Running a notebook then leaves ``git status`` clean: outputs stay
in your working copy (JupyterLab shows them), while git compares and commits the sources only.
Reads a notebook on stdin, writes it on stdout with every code cell's outputs and execution count
cleared and run-specific metadata (execution timings, widget state) dropped, in the layout Jupyter
itself writes (sorted keys, one-space indent, trailing newline), so a committed notebook passes
through unchanged. Standard library only: git runs it with any Python 3.
"""

from __future__ import annotations

import json
import sys

_VOLATILE_CELL_METADATA = ("execution", "ExecuteTime", "collapsed", "scrolled")
_VOLATILE_NOTEBOOK_METADATA = ("widgets",)


def strip(notebook: dict) -> dict:
    for cell in notebook.get("cells", []):
        if cell.get("cell_type") == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
        metadata = cell.get("metadata", {})
        for key in _VOLATILE_CELL_METADATA:
            metadata.pop(key, None)
    for key in _VOLATILE_NOTEBOOK_METADATA:
        notebook.get("metadata", {}).pop(key, None)
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
