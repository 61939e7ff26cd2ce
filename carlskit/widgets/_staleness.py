"""``StalenessHistogram``: the meta-training learner's gradient staleness, as a bar chart refreshed in place."""

from __future__ import annotations

from typing import Any, Callable

import ipywidgets
import numpy as np

from carlskit.widgets._display import PeriodicThread, render_png


class StalenessHistogram:
    """A bar chart of a learner's ``staleness_counts`` (bins of outer steps; the last bin: that many
    or more) with its ``dropped_fraction``; bins above ``max_staleness`` (dropped) are red.

    Args:
      status: returns the learner's status dict (e.g. ``MetaTraining.learner_status``).
      max_staleness: the learner's staleness bound.
      every_seconds: refresh period, on a background thread until :meth:`stop`.
    """

    def __init__(self, status: Callable[[], dict[str, Any]], max_staleness: int, every_seconds: float = 1.0) -> None:
        if not callable(status):
            raise TypeError(f"status must be callable, got {type(status).__name__}")
        self.status, self.max_staleness = status, max_staleness
        self.widget = ipywidgets.Image(format="png")
        self._updater = PeriodicThread(self.update, every_seconds, "carlskit-staleness")
        self.update()
        self._updater.start()

    def update(self) -> None:
        status = self.status()
        counts = status.get("staleness_counts") or []
        max_staleness = self.max_staleness

        def draw(figure):
            axes = figure.add_subplot(1, 1, 1)
            bins = np.arange(len(counts))
            axes.bar(bins, counts, color=["C0" if b <= max_staleness else "C3" for b in bins])
            axes.set_xlabel("staleness (outer steps; last bin: that many or more)", fontsize=8)
            axes.set_ylabel("gradients", fontsize=8)
            axes.set_title(f"staleness; dropped fraction {status.get('dropped_fraction', 0.0):.3f} "
                           f"(max_staleness {max_staleness})", fontsize=9)

        self.widget.value = render_png(draw, 7.0, 2.2)

    def stop(self) -> None:
        self._updater.stop()
