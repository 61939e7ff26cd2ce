"""Whether this process is a Jupyter kernel, decided without importing IPython or any UI library.

Core modules (training, makers, bank, lopt, moe) call this to decide whether to show widgets; the
widgets themselves are imported only when shown, so Dask workers, actors and command lines never
load ipywidgets, matplotlib or pandas for nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np


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


def step_done(bar: Any, loss: float | None, name: str = "loss") -> None:
    """Count one finished training step on ``bar`` with its loss (shown as ``name``). The first step's time (tracing and
    compiling the step, often far longer than a step) is left out of the bar's clock, so its rate
    and ETA are those of the steps to come, not of a compilation per step."""
    if bar.n == 0:
        bar.unpause()
    bar.update(1)
    if loss is not None:
        bar.set_postfix({name: f"{loss:.4f}"}, refresh=False)


class LoopDisplay:
    """What every training loop shows and logs, in one object: a tqdm bar, a live plot of its
    history (in a notebook), and its records written to a summary writer.

    ``Trainer.fit``, ``MoEModel.fit``, ``LearnedOptimizer.meta_train`` and the GAM paradigm build
    one; the loop calls :meth:`record` once per step (from any thread), :meth:`close` when it ends
    (same thread), and the caller's main thread calls :meth:`show_final_frames` afterwards.

    Args:
      history: the loop's :class:`~carlskit._history.History` (the plot reads it; the loop appends).
      total: steps the bar counts to; ``label``: the bar's label.
      progress: show the bar (tqdm's widget in a notebook, text on stderr elsewhere).
      live: show the live view (``None``: in a notebook only). With ``summaries`` that has a
        ``logdir`` the view is :class:`carlskit.widgets.LiveSummaries` reading what the writer
        flushes, else a :class:`carlskit.widgets.LivePlot` of ``curves``.
      curves: names in the records to plot against step (names missing from every record are left
        out), or a function returning ``{title: (steps, values)}``.
      title: the plot's title; ``postfix``: the record key shown beside the bar.
      summaries: a writer with ``scalar(name, value, step)``; every scalar of each record but
        ``step`` is written as ``{prefix}{name}``.
      plot_every: render every this many records (``None``: at most once a second, by time).
      callback: the loop's caller's ``callback(record)``, called last for each record.
    Created in the thread that shows it: a notebook shows its outputs in the cell that built it.
    """

    def __init__(self, history: Any, total: int, label: str, *, progress: bool = True, live: bool | None = None,
                 curves: Any = ("loss",), title: str = "training", postfix: str = "loss", summaries: Any = None,
                 prefix: str = "train/", plot_every: int | None = None, plot_seconds: float = 1.0,
                 width_inches: float = 7.0, callback: Any = None):
        self.history, self.postfix, self.summaries, self.prefix = history, postfix, summaries, prefix
        self.curves, self.plot_every, self.callback = curves, plot_every, callback
        self.bar, final_bar = progress_bar(total, label, not progress)
        self.plot = None
        final_frames = [final_bar]
        if in_notebook() if live is None else live:
            from IPython.display import display

            logdir = getattr(summaries, "logdir", None)
            if logdir is not None and not callable(curves):  # the summaries' own view, reading what is flushed
                from carlskit.widgets import LiveSummaries

                display(LiveSummaries(logdir, names=[prefix + name for name in curves]))
            else:
                from carlskit.widgets import LivePlot

                self.plot = LivePlot(title, every_seconds=plot_seconds, width_inches=width_inches)
                display(self.plot)  # from the calling thread; the loop's thread only sets values
                final_frames.append(self.plot.show_final_frame)
        self._final_frames = final_frames
        self._records = 0

    def record(self, record: dict) -> None:
        """One step done: count it on the bar (with ``record[postfix]``), write its scalars to the
        summaries, redraw the plot when due, and pass it to ``callback``."""
        value = record.get(self.postfix)
        if value is not None and np.ndim(value) == 0:
            step_done(self.bar, float(value), self.postfix)
        else:
            step_done(self.bar, None)
        if self.summaries is not None:
            for name, value in record.items():
                if name not in ("step", "wall_time") and np.ndim(value) == 0:
                    self.summaries.scalar(f"{self.prefix}{name}", value, record["step"])
        self._records += 1
        if self.plot_every is None:
            self.refresh()
        elif self._records % self.plot_every == 0:
            self.refresh(force=True)
        if self.callback is not None:
            self.callback(record)

    def refresh(self, force: bool = False) -> None:
        """Redraw the plot from the history (at most every ``plot_seconds`` unless ``force``)."""
        if self.plot is not None:
            self.plot.update(self._series(), force=force)

    def _series(self) -> dict:
        if callable(self.curves):
            return self.curves()
        series = {name: self.history.series(name) for name in self.curves}
        return {name.replace("_", " "): curve for name, curve in series.items() if len(curve[0])}

    def close(self) -> None:
        """The loop ended (in its thread): the bar closed and the plot drawn as it ended."""
        self.bar.close()
        self.refresh(force=True)

    def show_final_frames(self) -> None:
        """In the notebook's main thread, once the loop ended: make the saved outputs of the bar and
        plot show their last state (a notebook saved without widget state shows the first frame
        otherwise). Runs once; later calls do nothing."""
        final_frames, self._final_frames = self._final_frames, []
        for final_frame in final_frames:
            final_frame()
