"""Chaos: the process that logs summaries is SIGKILLed while it logs as fast as it can.

A child process (``summary_logger.py``) logs 20 scalars a step, a histogram and a text every 50
steps, into a :class:`SummaryWriter` with ``flush_every_seconds=0.1``, and records in a shared
file when each step's logging began and ended. The test SIGKILLs it after 1-2.5 s and reads the
files back with ``SummaryReader(on_corrupt="raise")``.

The bound asserted is the writer's documented one, stated in the child's own clock so that a
loaded machine cannot make it flap: once a logging call that began ``flush_every_seconds`` or more
after a point was logged has returned, that point is in the files (acknowledged by its aggregator,
with a client). So every step that ended ``flush_every_seconds`` before the last step the child
*completed* began must be read back, with no hole and no duplicate. In wall-clock terms the loss is
the flush period plus one flush's duration (the last call may be the one flushing); the child
measures its flushes and the test prints them with the figures of each trial.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from summary_logger import EVERY, NAMES, value_of

from carlskit.summaries import SummaryReader
from carlskit.widgets import LiveSummaries

pytestmark = pytest.mark.slow

FLUSH_EVERY_SECONDS = 0.1
ROWS = 2_000_000  # steps the child may log (16 bytes each in the progress file)
KILL_AFTER_SECONDS = (1.0, 1.8, 2.5, 1.4)  # after the child's first 200 steps
ROOT = Path(__file__).resolve().parents[2]


def run_and_kill(tmp_path: Path, kill_after: float, address: str | None = None, live: LiveSummaries | None = None
                 ) -> dict:
    """Start the logging child, SIGKILL it ``kill_after`` s after it got going (tailing the files
    with ``live`` meanwhile), and return what it had logged and what it had measured."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    logdir = tmp_path / "logs"
    progress_path, stats_path = tmp_path / "progress.f64", tmp_path / "stats.jsonl"
    np.zeros((ROWS, 2)).tofile(progress_path)
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    command = [sys.executable, str(Path(__file__).with_name("summary_logger.py")), str(logdir), str(progress_path),
               str(stats_path), str(FLUSH_EVERY_SECONDS)] + ([address] if address else [])
    child = subprocess.Popen(command, env=environment, cwd=ROOT)
    try:
        progress = np.memmap(progress_path, dtype=np.float64, mode="r").reshape(-1, 2)
        deadline = time.monotonic() + 120
        while progress[200, 1] == 0.0:
            assert child.poll() is None, f"the logging child exited with {child.returncode}"
            assert time.monotonic() < deadline, "the logging child did not get going in 120 s"
            time.sleep(0.02)
        kill_at = time.monotonic() + kill_after
        while time.monotonic() < kill_at:
            if live is not None:
                live.update()  # tail the files while they grow, torn last records included
            time.sleep(0.02)
        child.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
    finally:
        child.kill()
        child.wait()
    progress = np.array(progress)
    completed = int(np.flatnonzero(progress[:, 1])[-1])  # steps end in order: the last one whose calls returned
    last_began = progress[completed, 0]
    # The guarantee: every step whose calls returned flush_every_seconds before the last completed step began.
    guaranteed = int(np.searchsorted(progress[: completed + 1, 1], last_began - FLUSH_EVERY_SECONDS, side="right"))
    lines = [line for line in stats_path.read_text().splitlines() if line.endswith("}")]
    return {"logdir": logdir, "progress": progress, "completed": completed + 1, "guaranteed": guaranteed,
            "killed_at": killed_at, "last_began": last_began, "stats": json.loads(lines[-1]) if lines else {}}


def check_nothing_older_than_the_bound_is_lost(run: dict, reader: SummaryReader) -> str:
    """Assert every guaranteed step of every summary was read, with no hole and no duplicate;
    return the trial's figures."""
    guaranteed, progress, killed_at = run["guaranteed"], run["progress"], run["killed_at"]
    read = {}
    for index, name in enumerate(NAMES):
        frame = reader.scalars(name)
        steps = frame["step"].to_numpy()
        np.testing.assert_array_equal(steps, np.arange(steps.size), err_msg=f"{name}: a hole or a duplicate")
        np.testing.assert_array_equal(frame["value"].to_numpy(), value_of(index, steps), err_msg=name)
        read[name] = steps.size
    fewest = min(read.values())
    oldest_lost_age = killed_at - progress[fewest, 1] if fewest < run["completed"] else 0.0
    figures = (f"logged {run['completed']} steps, read {fewest} (guaranteed {guaranteed}); the oldest step lost "
               f"ended {oldest_lost_age:.3f} s before the kill; the bound: {FLUSH_EVERY_SECONDS} s before the last "
               f"completed step began, {killed_at - run['last_began'] + FLUSH_EVERY_SECONDS:.3f} s before the kill; "
               f"child's flushes: {run['stats']}")
    assert fewest >= guaranteed, f"points older than the bound were lost: {figures}"
    for kind_steps in (reader.histograms("chaos/histogram")["step"], reader.texts("chaos/text")["step"]):
        steps = np.asarray(kind_steps, dtype=np.int64)
        np.testing.assert_array_equal(steps, np.arange(steps.size) * EVERY)
        assert steps.size >= -(-guaranteed // EVERY), f"a histogram or text older than the bound was lost: {figures}"
    return figures


@pytest.mark.parametrize("trial", range(len(KILL_AFTER_SECONDS)))
def test_a_killed_writer_loses_nothing_logged_a_flush_period_before_its_last_call(tmp_path, trial):
    run = run_and_kill(tmp_path, KILL_AFTER_SECONDS[trial])
    figures = check_nothing_older_than_the_bound_is_lost(run, SummaryReader(run["logdir"], on_corrupt="raise"))
    print(f"\nwriter SIGKILL, direct, trial {trial}: {figures}")


def test_a_killed_writer_loses_nothing_acknowledged_by_its_aggregators(tmp_path):
    from process_helpers import checkout_cluster

    with checkout_cluster(2) as client:
        for trial, kill_after in enumerate(KILL_AFTER_SECONDS[:2]):
            run = run_and_kill(tmp_path / f"trial{trial}", kill_after, address=client.scheduler.address)
            figures = check_nothing_older_than_the_bound_is_lost(run, SummaryReader(run["logdir"], on_corrupt="raise"))
            print(f"\nwriter SIGKILL, 2 aggregators, trial {trial}: {figures}")


def test_live_summaries_tailing_the_files_of_a_killed_writer_show_every_point_within_the_bound(tmp_path):
    for trial, kill_after in enumerate(KILL_AFTER_SECONDS[:2]):
        (tmp_path / f"trial{trial}" / "logs").mkdir(parents=True)
        tailing = SummaryReader(tmp_path / f"trial{trial}" / "logs", on_corrupt="raise")
        live = LiveSummaries(tailing, names=NAMES[:2], max_points=10**9)  # full resolution: the newest step
        run = run_and_kill(tmp_path / f"trial{trial}", kill_after, live=live)
        live.update()
        assert live.renders >= 2  # it drew while the child was logging, and after the kill
        figures = check_nothing_older_than_the_bound_is_lost(run, tailing)
        fresh = SummaryReader(run["logdir"], on_corrupt="raise")
        for name in NAMES[:2]:
            assert live.latest[name]["step"] == fresh.count(name) - 1
            assert tailing.scalars(name).equals(fresh.scalars(name))
        print(f"\nwriter SIGKILL, LiveSummaries tailing, trial {trial}: {figures}")
