"""ClusterStatus shows a source's supervision state ("services"): one row per service, give-ups named."""

from carlskit.widgets import ClusterStatus


def test_services_entry_is_a_table_per_service_and_gave_up_services_are_named():
    report = {"outer_step": 12, "services": {
        "learner": {"state": "gave up", "failures": 7, "budget_left_seconds": 0.0, "reason": "no worker"},
        "es worker 0": {"state": "waiting", "failures": 0, "budget_left_seconds": 600.0, "reason": "learner down"}}}
    board = ClusterStatus(None, sources=[lambda: report], show_devices=False)
    text, page = repr(board), board.html.value
    assert "GAVE UP: learner" in text and "es worker 0" not in text.split("GAVE UP:")[1].splitlines()[0]
    assert "gave up: learner" in page and "<th>service</th>" in page and "<td>es worker 0</td>" in page
    assert "<td>waiting</td>" in page and "outer_step" in page
    report["services"]["learner"]["state"] = "running"
    board.refresh()
    assert "gave up" not in board.html.value and "GAVE UP" not in repr(board)
    board.close()
