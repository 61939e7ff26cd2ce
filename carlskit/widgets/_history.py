"""``LivePlot``: curves from an in-memory history (the trainer's losses, meta-training's outer loss),
an ipywidgets Image re-rendered off-screen and set from any thread. For summaries on disk use
:class:`carlskit.widgets.LiveSummaries`."""

from __future__ import annotations

import base64
import threading
import time

import numpy as np

from carlskit.widgets._display import FinalFrame, check_smoothing, placeholder_png, render_png, smooth


class LivePlot:
    """Curves of named series against step, updated in place.

    ``update(series)`` may be called from any thread: it renders a PNG and sets the widget's
    ``value`` (no ``display()`` from threads, no pyplot figure left open). Renders at most every
    ``every_seconds``; ``update(..., force=True)`` renders now.
    """

    def __init__(self, title: str = "training", *, every_seconds: float = 1.0, smoothing: float = 0.6,
                 width_inches: float = 7.0, height_inches: float = 2.8):
        import ipywidgets

        self.title = title
        self.every_seconds = every_seconds
        self.smoothing = check_smoothing(smoothing)
        self.size = (width_inches, height_inches)
        self.widget = ipywidgets.Image(value=placeholder_png(f"{title}: waiting for the first step"), format="png")
        self.renders = 0
        self._last = -float("inf")  # the first update always renders (monotonic time may start near 0 after boot)
        self._lock = threading.Lock()

    def update(self, series: dict[str, tuple[np.ndarray, np.ndarray]], *, force: bool = False) -> bool:
        """Render ``{name: (steps, values)}``; returns whether it rendered."""
        now = time.monotonic()
        if not force and now - self._last < self.every_seconds:
            return False
        with self._lock:
            self._last = now
            self.widget.value = render_png(lambda figure: self._draw(figure, series), *self.size)
            self.renders += 1
        return True

    def _draw(self, figure, series) -> None:
        axes = figure.subplots(1, max(len(series), 1), squeeze=False)[0]
        for ax, (name, (steps, values)) in zip(axes, series.items()):
            ax.plot(steps, values, alpha=0.3, color="C0")
            ax.plot(steps, smooth(values, self.smoothing), color="C0")
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.tick_params(labelsize=7)
        figure.suptitle(self.title, fontsize=10)

    def _bundle(self) -> dict:
        """The widget view with a PNG of the current frame and a line of text beside it (what a
        notebook saved without widget state, or a documentation page, shows)."""
        return FinalFrame.bundle(self.widget, {"image/png": base64.b64encode(bytes(self.widget.value)).decode("ascii"),
                                               "text/plain": f"LivePlot({self.title!r}, {self.renders} renders)"})

    def _ipython_display_(self) -> None:
        self._final_frame = FinalFrame()
        self._final_frame.show(self._bundle())

    def show_final_frame(self) -> bool:
        """Bring the displayed PNG up to the current frame (main thread only; see ``FinalFrame``)."""
        final_frame = getattr(self, "_final_frame", None)
        return final_frame is not None and final_frame.update(self._bundle)
