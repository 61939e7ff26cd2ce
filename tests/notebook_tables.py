"""A check on every table a notebook shows: unique column names, and no column without a value.

Installed into the kernels that ``make test`` runs the notebooks in (JupyterLab's or nbmake's), by an IPython startup
file that the repository's ``conftest.py`` puts in a session-scoped ``$IPYTHONDIR``: an AST
transformer wraps each cell's last expression, the value Jupyter displays, in :func:`check_table`,
so a bad table fails its notebook like any other error. This costs nothing extra (the notebooks run
anyway) and checks the tables the notebooks really build, at the size they are tested at, instead
of a copy of their code. Tables shown with an explicit ``display(...)`` are not wrapped.
"""

from __future__ import annotations

import ast
from typing import Any

CHECK_NAME = "__carlskit_check_table__"


def check_table(value: Any) -> Any:
    """``value`` unchanged; ``AssertionError`` when it is a DataFrame (or its Styler) with duplicate
    column names or a column that holds no value at all (only NaN)."""
    import pandas as pd

    frame = getattr(value, "data", None) if type(value).__name__ == "Styler" else value
    if isinstance(frame, pd.DataFrame):
        duplicated = sorted({str(c) for c in frame.columns[frame.columns.duplicated()]})
        if duplicated:
            raise AssertionError(f"the table shows duplicate columns {duplicated}: {list(map(str, frame.columns))}")
        if len(frame):
            empty = [str(c) for c in frame.columns if frame[c].isna().all()]
            if empty:
                raise AssertionError(f"the table shows columns without any value (all NaN): {empty}")
    return value


class _WrapLastExpression(ast.NodeTransformer):
    def visit_Module(self, module: ast.Module) -> ast.Module:
        if module.body and isinstance(module.body[-1], ast.Expr):
            last = module.body[-1]
            call = ast.Call(func=ast.Name(id=CHECK_NAME, ctx=ast.Load()), args=[last.value], keywords=[])
            module.body[-1] = ast.copy_location(ast.Expr(value=call), last)
            ast.fix_missing_locations(module)
        return module


def install(shell: Any) -> None:
    """Check every displayed cell result of this IPython ``shell`` with :func:`check_table`."""
    shell.user_ns[CHECK_NAME] = check_table
    shell.user_ns_hidden[CHECK_NAME] = check_table
    shell.ast_transformers.append(_WrapLastExpression())
