"""A live loss plot for notebooks: an ipywidgets Image re-rendered off-screen, set from any thread."""

from __future__ import annotations

import io
import threading
import time

import numpy as np


def in_notebook() -> bool:
    """True inside a Jupyter kernel (where widgets can render)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def smooth(values: np.ndarray, weight: float) -> np.ndarray:
    """Exponential moving average with bias correction (as TensorBoard's smoothing slider)."""
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"weight must be in [0, 1), got {weight}")
    out = np.empty(len(values), dtype=np.float64)
    average, correction = 0.0, 1.0
    for i, value in enumerate(values):
        average = weight * average + (1 - weight) * value
        correction *= weight
        out[i] = average / (1 - correction) if correction < 1 else value
    return out


class LivePlot:
    """Curves of named series against step, updated in place.

    ``update(series)`` may be called from any thread: it renders a PNG with a non-pyplot matplotlib
    ``Figure`` (closed with the call) and sets the widget's ``value``; no ``display()`` from threads.
    Renders at most every ``every_seconds``; ``update(..., force=True)`` renders now.
    """

    def __init__(self, title: str = "training", *, every_seconds: float = 1.0, smoothing: float = 0.6,
                 width_inches: float = 7.0, height_inches: float = 2.8):
        import ipywidgets

        self.title = title
        self.every_seconds = every_seconds
        self.smoothing = smoothing
        self.size = (width_inches, height_inches)
        self.widget = ipywidgets.Image(format="png")
        self.renders = 0
        self._last = 0.0
        self._lock = threading.Lock()

    def update(self, series: dict[str, tuple[np.ndarray, np.ndarray]], *, force: bool = False) -> bool:
        """Render ``{name: (steps, values)}``; returns whether it rendered."""
        now = time.monotonic()
        if not force and now - self._last < self.every_seconds:
            return False
        with self._lock:
            self._last = now
            self.widget.value = self.render_png(series)
            self.renders += 1
        return True

    def render_png(self, series: dict[str, tuple[np.ndarray, np.ndarray]]) -> bytes:
        from matplotlib.figure import Figure

        figure = Figure(figsize=self.size, dpi=90)
        axes = figure.subplots(1, max(len(series), 1), squeeze=False)[0]
        for ax, (name, (steps, values)) in zip(axes, series.items()):
            values = np.asarray(values, dtype=np.float64)
            ax.plot(steps, values, alpha=0.3, color="C0")
            if len(values):
                ax.plot(steps, smooth(values, self.smoothing), color="C0")
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.tick_params(labelsize=7)
        figure.suptitle(self.title, fontsize=10)
        figure.tight_layout()
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png")
        return buffer.getvalue()
