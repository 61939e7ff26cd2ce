"""Helpers shared by test modules (imported by name: tests/ is on sys.path)."""

from __future__ import annotations

import time

import psutil


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


def wait_until(condition, seconds: float = 60.0, every: float = 0.05) -> None:
    """Poll ``condition()`` until true; fail the test after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(every)


def kill_worker(client, address: str) -> int:
    """SIGKILL the process of the Dask worker at ``address`` (its nanny starts a new one); returns its PID."""
    import os
    import signal

    pid = client.run(os.getpid, workers=[address])[address]
    os.kill(pid, signal.SIGKILL)
    return pid
