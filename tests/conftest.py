"""Shared test fixtures: no test may leave a process behind."""

from __future__ import annotations

import os

import psutil
import pytest
from process_helpers import wait_for_no_children


@pytest.fixture
def no_leftover_processes():
    """Fail the test if it leaves child processes (Dask workers, schedulers) running."""
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    yield
    alive = wait_for_no_children(before)
    leftovers = []
    for child in alive:
        try:
            leftovers.append(" ".join(child.cmdline()[:4]))
            child.kill()
        except psutil.NoSuchProcess:
            pass
    assert not leftovers, f"test left processes running: {leftovers}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """With ``CI`` set, a skip is a failure: missing data or tools must show up, not pass silently."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped with CI set (a skip is a failure in CI): {reason}"
