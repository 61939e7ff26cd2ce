"""Widgets: bad arguments raise errors naming them and leave the widget's data unchanged."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from carlskit.widgets import EvalCurves, LivePlot, LiveSummaries, curves_frame, smooth


@pytest.mark.parametrize("weight, error", [(1.0, ValueError), (2.0, ValueError), (-0.5, ValueError),
                                           (float("nan"), ValueError), ("0.5", TypeError)])
def test_smooth_rejects_weights_outside_zero_one(weight, error):
    # Before: 1.0 -> ZeroDivisionError, 2.0 -> a silently wrong curve, -0.5 / NaN -> silently unsmoothed / all NaN.
    # A string is a wrong type: TypeError since issue 16 (was ValueError).
    with pytest.raises(error, match="weight"):
        smooth(np.arange(5.0), weight)


def test_smooth_needs_1d_values():
    with pytest.raises(ValueError, match="1-D"):
        smooth(np.ones((2, 3)), 0.5)
    np.testing.assert_allclose(smooth([1.0, np.nan, 3.0], 0.0), [1.0, np.nan, 3.0])


def test_live_plot_checks_smoothing():
    with pytest.raises(ValueError, match="smoothing"):
        LivePlot(smoothing=1.0)


def test_live_summaries_keeps_the_smoothing_it_accepts(tmp_path):
    live = LiveSummaries(tmp_path, smoothing=0.995)
    assert live.smoothing == 0.995  # the slider silently clamped it to 0.99
    # A bool or a string is a wrong type: TypeError since issue 16 (was ValueError).
    for kwargs, name, error in ((dict(max_panels=0), "max_panels", ValueError),
                                (dict(max_points=True), "max_points", TypeError),
                                (dict(every_seconds="1"), "every_seconds", TypeError),
                                (dict(smoothing=1.0), "smoothing", ValueError)):
        with pytest.raises(error, match=name):
            LiveSummaries(tmp_path, **kwargs)


def test_eval_curves_reject_non_numeric_values_and_unknown_checkpoints():
    curves = EvalCurves({"c1": {"tasks": {"train": [3.0, 2.0, 1.0]}}})
    bad = pd.DataFrame({"checkpoint": ["c2"], "task_set": ["tasks"], "split": ["train"], "value": ["abc"]})
    with pytest.raises(ValueError, match="value"):  # was accepted and stored as a string
        curves.add(bad)
    with pytest.raises(ValueError, match="values"):
        curves_frame({"c": {"t": {"s": ["a", "b"]}}})
    assert curves.checkpoints == ["c1"] and curves.frame["value"].dtype == np.float64
    with pytest.raises(ValueError, match="nope"):  # was an empty table / an empty plot
        curves.final_values("nope")
    with pytest.raises(ValueError, match="nope"):
        curves.render("nope")
    assert curves.final_values().loc["tasks", "train"] == 1.0
