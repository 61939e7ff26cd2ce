"""A process that logs summaries as fast as it can until it is SIGKILLed (tests/chaos/test_summary_writer_kill.py).

``python summary_logger.py LOGDIR PROGRESS STATS FLUSH_EVERY_SECONDS [SCHEDULER_ADDRESS]``

Every step logs 20 scalars (plus a histogram and a text every 50 steps) and records in ``PROGRESS``
(a float64 memmap of shape ``(steps, 2)`` made by the test) the ``time.monotonic()`` before its first
call and after its last call returned, so the test knows what had been logged when, even after a
SIGKILL. Every 1,000 steps it appends what it measured of the writer's flushes to ``STATS`` (one
JSON line): the flushes so far, the longest, the largest, the longest gap between two flushes, and
how many a logging call did itself.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import numpy as np

NAMES = [f"chaos/metric_{index:02d}" for index in range(20)]
EVERY = 50  # a histogram and a text every 50 steps


def value_of(name_index: int, step: int) -> float:
    return name_index * 1000.0 + step * 0.25


def main(logdir: str, progress_path: str, stats_path: str, flush_every_seconds: float, address: str | None) -> None:
    from carlskit.summaries import SummaryWriter

    flushes: list[tuple[float, float, int, bool]] = []  # (start, seconds, entries, by the logging thread)
    measured = SummaryWriter._flush_step

    def flush_step(writer):
        start, entries = time.monotonic(), writer._buffered
        try:
            return measured(writer)
        finally:
            flushes.append((start, time.monotonic() - start, entries, threading.current_thread() is main_thread))

    main_thread = threading.current_thread()
    SummaryWriter._flush_step = flush_step
    client = None
    if address:
        from distributed import Client

        client = Client(address)
    progress = np.memmap(progress_path, dtype=np.float64, mode="r+")
    progress = progress.reshape(-1, 2)
    histogram = np.random.default_rng(0).normal(size=1_000)
    writer = SummaryWriter(logdir, client=client, flush_every_seconds=flush_every_seconds)
    with open(stats_path, "w") as stats:
        for step in range(progress.shape[0]):
            progress[step, 0] = time.monotonic()
            for index, name in enumerate(NAMES):
                writer.scalar(name, value_of(index, step), step)
            if step % EVERY == 0:
                writer.array("chaos/histogram", histogram, step)
                writer.text("chaos/text", f"step {step}", step)
            progress[step, 1] = time.monotonic()
            if step % 1_000 == 0 and len(flushes) > 1:
                starts = np.array([flush[0] for flush in flushes])
                stats.write(json.dumps({
                    "step": step, "flushes": len(flushes),
                    "longest_flush_seconds": max(flush[1] for flush in flushes),
                    "largest_flush_entries": max(flush[2] for flush in flushes),
                    "longest_gap_seconds": float(np.diff(starts).max()),
                    "mean_gap_seconds": float(np.diff(starts).mean()),
                    "flushes_by_the_logging_call": sum(flush[3] for flush in flushes)}) + "\n")
                stats.flush()
    time.sleep(3600)  # ran out of progress rows: wait for the kill


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5] if len(sys.argv) > 5 else None)
