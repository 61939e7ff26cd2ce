"""A notebook saved after a run shows each live display's last frame, not its first.

Widget views are not saved as anything a reader sees (a notebook saved without widget state, a
documentation page): what they see is the display bundle's static fallback, rendered when the
display appeared (a bar at 0/5, a plot saying "waiting"). Here a real kernel (nbclient) runs a fit
with its progress bar and live plot, a background fit, and a LiveSummaries board; the executed
notebook's outputs must show the final state of each.
"""

from __future__ import annotations

import base64
from pathlib import Path

import nbclient
import nbformat

from carlskit.widgets._display import placeholder_png

SETUP = f'''
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
from tiny_models import Linear, mse, sum_batch as batch
import optax
from carlskit.training import Trainer
'''

CELLS = [
    SETUP,
    'Trainer(Linear(), optax.sgd(0.01), mse).fit(batch, 5, progress="blocking", live=True); None',
    'handle = Trainer(Linear(), optax.sgd(0.01), mse).fit(batch, 6, progress="background", live=True, block=False)',
    'handle.wait(); None',
    '''import tempfile
from carlskit.summaries import SummaryWriter
from carlskit.widgets import LiveSummaries
logdir = tempfile.mkdtemp()
live = LiveSummaries(logdir, names=["loss"], every_seconds=60)
live''',
    '''with SummaryWriter(logdir) as writer:
    for step in range(20):
        writer.scalar("loss", 1.0 / (1 + step), step)
live.stop()''',
]


def _outputs(notebook, index, mime):
    return [output["data"][mime] for output in notebook.cells[index].outputs
            if output.get("output_type") == "display_data" and mime in output.get("data", {})]


def test_saved_outputs_show_the_last_frame_of_bars_plots_and_boards(tmp_path):
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in CELLS]
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()

    bar, = [text for text in _outputs(notebook, 1, "text/plain") if text.startswith("blocking")]
    assert "5/5" in bar and "100%" in bar, bar
    plot, = _outputs(notebook, 1, "image/png")
    assert base64.b64decode(plot) != placeholder_png("Trainer: waiting for the first step"), "the last frame"
    background, = [text for text in _outputs(notebook, 2, "text/plain") if text.startswith("background")]
    assert "6/6" in background, background  # updated by handle.wait() in a later cell
    board, = _outputs(notebook, 4, "text/html")
    empty = base64.b64encode(placeholder_png("waiting for the first summaries")).decode()
    assert "<img" in board and empty not in board, "the board's saved frame has the 20 points"
