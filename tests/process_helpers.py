"""Helpers shared by test modules (imported by name: tests/ is on sys.path)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import time

import psutil


def wait_for_no_children(before: set[int], seconds: float = 20.0, parent: psutil.Process | None = None
                         ) -> list[psutil.Process]:
    """Wait until every child process of ``parent`` (this one by default) not in ``before`` has exited;
    return those still alive."""
    deadline = time.monotonic() + seconds
    parent = parent or psutil.Process()
    while True:
        alive = []
        for child in parent.children(recursive=True):
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


@contextlib.contextmanager
def checkout_cluster(n_workers: int = 2):
    """A ``distributed.Client`` of a LocalCluster whose worker processes import this checkout (its
    root is put on ``PYTHONPATH`` while the cluster runs, then restored)."""
    import distributed

    root = str(pathlib.Path(__file__).resolve().parents[1])
    old_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, old_path]))
    cluster = distributed.LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=True,
                                       dashboard_address="127.0.0.1:0")  # None still takes 8787
    client = distributed.Client(cluster)
    try:
        client.wait_for_workers(n_workers, timeout=120)  # under load, workers may register after start-up
        yield client
    finally:
        client.close()
        cluster.close()
        if old_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_path


@contextlib.contextmanager
def connected_cluster(n_workers: int = 2, **connect_arguments):
    """``carlskit.connect(n_workers=..., **connect_arguments)``'s embedded cluster (or its
    ``worker_groups=``); fails if it leaves processes behind."""
    import carlskit

    before = {child.pid for child in psutil.Process().children(recursive=True)}
    if "worker_groups" in connect_arguments:
        client = carlskit.connect(**connect_arguments)
    else:
        client = carlskit.connect(n_workers=n_workers, **connect_arguments)
    try:
        yield client
    finally:
        client.close()
    leftovers = wait_for_no_children(before)
    assert not leftovers, f"cluster left processes running: {leftovers}"
