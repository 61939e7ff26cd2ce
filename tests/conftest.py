"""Shared test fixtures: no test may leave a process behind."""

from __future__ import annotations

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
