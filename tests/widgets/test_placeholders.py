"""Image widgets show a placeholder, never an empty image (a broken-image icon), before their first frame."""

from __future__ import annotations

import numpy as np

from carlskit.widgets import LiveSummaries
from carlskit.widgets._history import LivePlot

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_live_summaries_show_a_placeholder_until_the_first_frame(tmp_path):
    live = LiveSummaries(tmp_path)
    try:
        assert bytes(live.image.value).startswith(PNG_MAGIC)
        assert live.png == b"", "png is the first real frame, not the placeholder"
    finally:
        live.close()


def test_the_trainers_live_plot_shows_a_placeholder_until_the_first_step():
    plot = LivePlot("Trainer")
    placeholder = bytes(plot.widget.value)
    assert placeholder.startswith(PNG_MAGIC)
    plot.update({"loss": (np.arange(3), np.array([3.0, 2.0, 1.0]))}, force=True)
    assert bytes(plot.widget.value).startswith(PNG_MAGIC) and bytes(plot.widget.value) != placeholder
