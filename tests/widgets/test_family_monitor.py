"""FamilyMonitor: the learner's per-family figures with diverging and noisy families flagged first."""

import pytest

from carlskit.widgets import FamilyMonitor, flag_families

ROWS = [
    {"task_family": "steady", "count": 9, "loss_all": 1.0, "loss_latest": 0.9, "grad_variance": 1.0},
    {"task_family": "diverging", "count": 9, "loss_all": 1.0, "loss_latest": 3.0, "grad_variance": 2.0},
    {"task_family": "noisy", "count": 9, "loss_all": 1.0, "loss_latest": 1.0, "grad_variance": 50.0},
    {"task_family": "new", "count": 1, "loss_all": 1.0, "loss_latest": 1.0, "grad_variance": None},
]


def test_a_diverging_and_a_noisy_family_are_flagged_and_come_first():
    rows = flag_families(ROWS)
    assert [(r["task_family"], r["flag"]) for r in rows[:2]] == [("diverging", "diverging"), ("noisy", "noisy")]
    assert {r["task_family"]: r["flag"] for r in rows[2:]} == {"steady": "", "new": ""}
    assert rows[0]["latest_over_all"] == 3.0 and rows[1]["variance_over_median"] == pytest.approx(25.0)
    nan_row = flag_families([{"task_family": "x", "loss_all": 1.0, "loss_latest": float("nan")}])
    assert nan_row[0]["flag"] == "diverging"


def test_the_monitor_reads_a_status_source_and_shows_flagged_rows_in_red():
    class Source:
        families = ROWS[:1]

        def status(self):
            return {"families": self.families}

    source = Source()
    monitor = FamilyMonitor(source, every_seconds=None)
    assert "0 flagged" in monitor._repr_html_() and "color:#c00" not in monitor._repr_html_()
    source.families = ROWS
    monitor.refresh()
    page = monitor._repr_html_()
    assert "2 flagged" in page and page.index("diverging") < page.index("steady") and "color:#c00" in page
    assert "diverging" in repr(monitor)
    assert FamilyMonitor(lambda: ROWS, every_seconds=None).rows[0]["task_family"] == "diverging"
    with pytest.raises(TypeError, match="source"):
        FamilyMonitor(3)
    with pytest.raises(ValueError, match="loss_ratio"):
        FamilyMonitor(lambda: ROWS, loss_ratio=0)
