"""Widget state, rendering and fallbacks (no browser: see test_browser.py for that)."""

from __future__ import annotations

import time

import numpy as np
import pandas as pd
import pytest

import carlskit
from carlskit.bank import KnowledgeBank
from carlskit.summaries import SummaryReader, SummaryWriter
from carlskit.widgets import ClusterStatus, EvalCurves, LiveSummaries, curves_frame, smooth

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def write_losses(writer: SummaryWriter, start: int, stop: int) -> None:
    for step in range(start, stop):
        writer.scalar("loss", 2.0 * np.exp(-step / 50) + 0.01, step)
        writer.scalar("accuracy", 1 - np.exp(-step / 30), step)
    writer.flush()


@pytest.fixture
def logdir(tmp_path):
    with SummaryWriter(tmp_path, flush_every_seconds=60) as writer:
        write_losses(writer, 0, 50)
        yield tmp_path, writer


def test_live_summaries_png_changes_as_data_grows(logdir):
    path, writer = logdir
    live = LiveSummaries(path, names=["loss", "accuracy"])
    try:
        assert live.update()
        first = live.png
        assert first.startswith(PNG_MAGIC)
        assert not live.update(), "nothing new: no redraw"
        write_losses(writer, 50, 120)
        assert live.update()
        assert live.png.startswith(PNG_MAGIC) and live.png != first
        assert live.latest["loss"]["step"] == 119
        assert "loss = " in live.status.value
    finally:
        live.close()


def test_live_summaries_toggles_and_pause(logdir):
    path, writer = logdir
    live = LiveSummaries(SummaryReader(path), names=["loss"])
    try:
        live.update()
        plain = live.png
        live.log_scale = True  # the checkbox observer redraws at once
        assert live.log_scale and live.png != plain
        logarithmic = live.png
        live.smoothing = 0.9
        assert live.smoothing_slider.value == 0.9 and live.png != logarithmic
        live.pause()
        renders = live.renders
        write_losses(writer, 50, 80)
        assert not live.update() and live.renders == renders and live.paused
        assert live.pause_button.description == "resume"
        live.resume()  # catches up at once
        assert live.renders == renders + 1 and live.latest["loss"]["step"] == 79
        with pytest.raises(ValueError, match="smoothing"):
            live.smoothing = 1.0
    finally:
        live.close()


def test_live_summaries_background_thread_updates_in_place(logdir):
    path, writer = logdir
    live = LiveSummaries(path, names=["loss"], every_seconds=0.05)
    image = live.image
    image_png = lambda: bytes(image.value)  # noqa: E731
    bundle = live._repr_mimebundle_()  # displaying starts the updates
    try:
        assert WIDGET_VIEW in bundle and "<img" in bundle["text/html"]
        assert live.running
        first = image_png()
        write_losses(writer, 50, 150)
        deadline = time.monotonic() + 20
        while image_png() == first and time.monotonic() < deadline:
            time.sleep(0.05)
        assert image_png() != first and live.image is image  # same widget, new bytes
    finally:
        live.close()
    assert not live.running


def test_live_summaries_fallbacks_and_empty_logdir(tmp_path):
    live = LiveSummaries(tmp_path / "nothing-yet")
    html = live._repr_html_()  # no directory yet: the plot says "no scalar summaries yet", the table is empty
    assert "<img" in html and "<i>none</i>" in html and "loss" not in html
    assert "LiveSummaries(" in repr(live) and "stopped" in repr(live)
    with SummaryWriter(tmp_path / "nothing-yet") as writer:
        writer.scalar("loss", 1.0, 0)
    html = live._repr_html_()
    assert "<img" in html and "loss" in html
    live.update()
    assert "loss" in repr(live)
    with pytest.raises(TypeError, match="source"):
        LiveSummaries(42)
    with pytest.raises(TypeError, match="names"):
        LiveSummaries(tmp_path, names="loss")
    with pytest.raises(ValueError, match="every_seconds"):
        LiveSummaries(tmp_path, every_seconds=0)


def test_smooth_is_a_debiased_ema():
    values = np.array([1.0, 3.0, np.nan, 5.0])
    weight = 0.5
    expected = [1.0, (0.25 + 1.5) / 0.75, (0.25 + 1.5) / 0.75, (0.5 * 1.75 + 2.5) / 0.875]
    np.testing.assert_allclose(smooth(values, weight), expected)
    np.testing.assert_array_equal(smooth(values, 0.0), values)


CURVES = {
    "ckpt-100": {"fashion-mlp": {"train": [2.3, 1.1, 0.7], "valid": [2.3, 1.3, 0.9], "test": [2.3, 1.4, 1.0]},
                 "cifar-conv": {"train": ([0, 10, 20], [2.3, 2.0, 1.8])}},
    "ckpt-200": {"fashion-mlp": {"train": [2.3, 0.9, 0.5], "valid": [2.3, 1.0, 0.6]}},
}


def test_curves_frame_accepts_nested_dicts_and_frames():
    frame = curves_frame(CURVES)
    assert list(frame.columns) == ["checkpoint", "task_set", "split", "step", "value"]
    assert len(frame) == 9 + 3 + 6
    cifar = frame[frame["task_set"] == "cifar-conv"]
    assert cifar["step"].tolist() == [0, 10, 20]
    again = curves_frame(frame.drop(columns="step"))
    assert again[again["task_set"] == "fashion-mlp"]["step"].tolist()[:3] == [0, 1, 2]
    with pytest.raises(ValueError, match="lacks columns"):
        curves_frame(pd.DataFrame({"value": [1.0]}))
    with pytest.raises(TypeError, match="data must be"):
        curves_frame([1, 2, 3])
    with pytest.raises(ValueError, match=r"\['ckpt'\]\['t'\]\['train'\]"):
        curves_frame({"ckpt": {"t": {"train": ([0, 1], [1.0])}}})


def test_eval_curves_selector_and_streaming():
    curves = EvalCurves(CURVES)
    assert curves.checkpoints == ["ckpt-100", "ckpt-200"] and curves.checkpoint == "ckpt-200"
    latest = curves.png
    assert latest.startswith(PNG_MAGIC)
    curves.selector.value = "ckpt-100"  # the user picks another checkpoint in the dropdown
    assert curves.png != latest
    assert curves.final_values().loc["fashion-mlp", "test"] == 1.0
    assert "cifar-conv" in curves.table.value
    curves.add({"ckpt-300": {"fashion-mlp": {"train": [2.3, 0.8, 0.4]}}})
    assert curves.checkpoint == "ckpt-100", "a user's choice is kept when new checkpoints arrive"
    curves.select("ckpt-300")
    curves.add({"ckpt-400": {"fashion-mlp": {"train": [2.3, 0.7, 0.3]}}})
    assert curves.checkpoint == "ckpt-400", "following the newest checkpoint"
    curves.add({"ckpt-400": {"fashion-mlp": {"train": [2.3, 0.7, 0.2]}}})  # replaced, not doubled
    assert curves.final_values().loc["fashion-mlp", "train"] == 0.2
    with pytest.raises(ValueError, match="not in data"):
        curves.select("ckpt-999")
    assert "EvalCurves(4 checkpoints" in repr(curves)
    bundle = curves._repr_mimebundle_()
    assert WIDGET_VIEW in bundle and bundle["text/html"].count("<img") == 3


def test_eval_curves_empty():
    curves = EvalCurves()
    assert curves.checkpoints == [] and curves.png.startswith(PNG_MAGIC)
    assert "0 checkpoints" in repr(curves)


def small_bank() -> KnowledgeBank:
    """An in-process bank with one table of 10 rows: a real ``status()`` source."""
    bank = KnowledgeBank(num_shards=2)
    bank.create_table("embeddings", dim=4)
    bank.lookup("embeddings", np.arange(10), insert_missing=True)
    return bank


def test_cluster_status_with_a_client_and_pluggable_sources(no_leftover_processes):
    client = carlskit.connect(n_workers=1)
    try:
        bank = small_bank()
        def broken_maker():
            return 1 / 0

        status = ClusterStatus(client, sources=[bank, lambda: {"lag_s": 0.25}, lambda: {"lag_s": 1.5},
                                                broken_maker])
        snapshot = status.snapshot
        assert len(snapshot["workers"]) == 1 and snapshot["workers"][0]["threads"] == 1
        assert {row["process"] for row in snapshot["devices"]} == {"client", snapshot["workers"][0]["worker"]}
        assert snapshot["sources"]["KnowledgeBank"]["shards"] == 2
        assert snapshot["sources"]["KnowledgeBank"]["tables"][0] == {
            "table": "embeddings", "rows": 10, "rows_per_shard": [6, 4], "pending_gradients": 0,
            "min_version": None, "max_version": None}
        assert snapshot["sources"]["<lambda>"] == {"lag_s": 0.25}
        assert snapshot["sources"]["<lambda> (2)"] == {"lag_s": 1.5}
        assert "ZeroDivisionError" in snapshot["sources"]["broken_maker"]["error"]
        bank.create_table("queries", dim=4)
        status.refresh()
        assert "queries" in status.html.value and "embeddings" in repr(status)
        assert WIDGET_VIEW in status._repr_mimebundle_()
        with pytest.raises(TypeError, match="source"):
            ClusterStatus(client, sources=[42])
        status.close()
    finally:
        client.close()


def test_cluster_status_without_cluster_or_front_end():
    status = ClusterStatus(sources=[small_bank()], show_devices=False)
    assert "0 workers" in repr(status) and "embeddings" in repr(status)
    assert "no cluster" in status._repr_html_()
    with pytest.raises(TypeError, match="client"):
        ClusterStatus(client="tcp://nowhere")


def test_live_plot_updates_in_place_from_another_thread_and_rate_limits():
    import threading

    from carlskit.widgets import LivePlot, in_notebook

    assert not in_notebook()
    plot = LivePlot("history", every_seconds=3600)
    steps = np.arange(20)
    thread = threading.Thread(target=plot.update, args=({"loss": (steps, np.exp(-steps / 5))},))
    thread.start()
    thread.join()
    first = bytes(plot.widget.value)
    assert first.startswith(b"\x89PNG") and plot.renders == 1
    assert not plot.update({"loss": (steps, steps)}), "within every_seconds: no render"
    assert plot.update({"loss": (steps, steps), "staleness": (steps, steps % 5)}, force=True)
    assert bytes(plot.widget.value) != first and plot.renders == 2


def test_core_packages_load_no_ui_library():
    # Dask workers, bank actors, learners and command lines import these packages; the UI libraries
    # (ipywidgets, matplotlib, pandas) load only when something is shown. (IPython itself comes in
    # through flax.nnx's repr module, which is not ours to change.)
    import subprocess
    import sys

    code = ("import sys\n"
            "import carlskit.training, carlskit.bank, carlskit.makers, carlskit.lopt, carlskit.moe, carlskit.cluster\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'ipywidgets', 'matplotlib', 'pandas'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_eval_curves_axis_labels_are_the_callers():
    default = EvalCurves(CURVES)
    labelled = EvalCurves(CURVES, x_label="gradient step", y_label="accuracy")
    assert (default.x_label, default.y_label) == ("inner step", "loss")
    assert labelled.png.startswith(PNG_MAGIC) and labelled.png != default.png, "the labels are drawn"
    with pytest.raises(TypeError, match="x_label"):
        EvalCurves(CURVES, x_label=3)
