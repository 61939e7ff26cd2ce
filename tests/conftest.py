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


#: Run by one pytest-xdist worker, in collection order (``make test`` runs ``-n 2 --dist loadgroup``):
#: the tests that start JAX process groups or look for their rank processes on the whole machine
#: (test_spmd counts every ``carlskit.cluster._rank`` process, so another worker's group would be
#: counted), the notebooks (notebook 12 starts groups; each run writes ``notebooks/executed/``; nbmake's
#: items are ``notebooks/...``),
#: then the docs rendered from those executed copies, the README's snippets (they start a group)
#: and the wheel build (it writes ``build/`` in the checkout).
ONE_WORKER = ("notebooks/", "tests/cluster/test_spmd.py", "tests/moe/test_moe_processes.py", "tests/notebooks/",
              "tests/test_docs.py", "tests/test_readme.py", "tests/test_release.py",
              "tests/training/test_fit_processes.py")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook turns the groups into node ids
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(ONE_WORKER):
            item.add_marker(pytest.mark.xdist_group("one_worker"))
