"""Whether this process is a Jupyter kernel, decided without importing IPython or any UI library.

Core modules (training, makers, bank, lopt, moe) call this to decide whether to show widgets; the
widgets themselves are imported only when shown, so Dask workers, actors and command lines never
load ipywidgets, matplotlib or pandas for nothing.
"""

from __future__ import annotations

import sys


def in_notebook() -> bool:
    """True inside a Jupyter kernel (where widgets can render). A kernel has imported IPython
    before any user code runs, so a process that has not imported it is not one."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"
