"""Shared test fixtures: no test may leave a process behind."""

from __future__ import annotations

import time

import psutil
import pytest


def wait_for_no_children(before: set[int], seconds: float = 20.0) -> list[psutil.Process]:
    """Wait until every child process not in ``before`` has exited; return those still alive."""
    deadline = time.monotonic() + seconds
    while True:
        alive = []
        for child in psutil.Process().children(recursive=True):
            try:
                if child.pid in before or child.status() == psutil.STATUS_ZOMBIE:
                    continue
                if any("resource_tracker" in part for part in child.cmdline()):
                    continue  # multiprocessing's one helper per session, not a leak
            except psutil.NoSuchProcess:
                continue
            alive.append(child)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


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
