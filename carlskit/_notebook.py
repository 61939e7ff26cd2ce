"""Whether this process is a Jupyter kernel, decided without importing IPython or any UI library.

Core modules (training, makers, bank, lopt, moe) call this to decide whether to show widgets; the
widgets themselves are imported only when shown, so Dask workers, actors and command lines never
load ipywidgets, matplotlib or pandas for nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


def in_notebook() -> bool:
    """True inside a Jupyter kernel (where widgets can render). A kernel has imported IPython
    before any user code runs, so a process that has not imported it is not one."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def progress_bar(total: int, desc: str, disable: bool = False) -> tuple[Any, Callable[[], Any]]:
    """A tqdm bar and a function that brings its saved output up to date.

    In a notebook the bar is tqdm's widget, displayed with a display id: the returned function,
    called from the main thread once the run ends, replaces the text fallback displayed beside it
    (``0/300`` when it was shown) with the bar's last state, which is what a notebook saved without
    widget state, or a documentation page, shows. Elsewhere it is tqdm's text bar on stderr and
    the function does nothing.
    """
    if disable or not in_notebook():
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc=desc, disable=disable, leave=True)
        bar.set_postfix_str("compiling the step", refresh=False)
        return bar, lambda: None
    from tqdm.notebook import tqdm as notebook_tqdm

    from carlskit.widgets import FinalFrame

    bar = notebook_tqdm(total=total, desc=desc, leave=True, display=False)
    bar.set_postfix_str("compiling the step", refresh=False)

    def bundle() -> dict[str, Any]:
        return FinalFrame.bundle(bar.container, {"text/plain": str(bar)})

    frame = FinalFrame()
    frame.show(bundle())
    return bar, lambda: frame.update(bundle)


def step_done(bar: Any, loss: float) -> None:
    """Count one finished training step on ``bar`` with its loss. The first step's time (tracing and
    compiling the step, often far longer than a step) is left out of the bar's clock, so its rate
    and ETA are those of the steps to come, not of a compilation per step."""
    if bar.n == 0:
        bar.unpause()
    bar.update(1)
    bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
