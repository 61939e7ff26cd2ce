"""What every long background computation (a *campaign*: meta-training a learned optimizer, training
the shipped translator) needs around its own loop, in one place.

* a **log**: one JSON line per saved state (:func:`append_log_line`), appended by one ``write`` on
  an ``O_APPEND`` descriptor and fsync'd, so a kill leaves at worst a torn last line, which
  :func:`read_log` drops; :func:`repair_log` makes the log end at the state a resume loaded;
* **stop requests** (:func:`stop_requests`): SIGINT or SIGTERM (``kill``, the notebook's stop button,
  a scheduler ending the job) ask the loop to stop at its next step boundary, where it saves;
* **CPU time across runs** (:class:`CampaignClock`): interrupted runs add up.

The state itself is saved by :class:`carlskit.CheckpointStore` (atomic, checksummed).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import threading
import time
from typing import Any, Callable, Iterator

from carlskit._serialization import atomic_write, filesystem

#: The campaign log's name in its run directory.
LOG_NAME = "campaign_log.jsonl"


def append_log_line(path: str | os.PathLike, record: dict[str, Any]) -> None:
    """One JSON line appended by a single ``write`` on an ``O_APPEND`` descriptor, then fsync'd: a
    kill leaves the previous lines whole (at worst a torn last line, which :func:`read_log` drops)."""
    line = (json.dumps(record, sort_keys=True, allow_nan=False) + "\n").encode()
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(descriptor, line)
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def read_log(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The log's records; a last line without its newline (a torn write) is left out."""
    path = pathlib.Path(path)
    if not path.exists():
        return []
    lines = path.read_bytes().split(b"\n")
    return [json.loads(line) for line in lines[:-1] if line.strip()]


def repair_log(path: str | os.PathLike, step: int, last: dict[str, Any] | None = None, *,
               key: str = "step") -> list[dict[str, Any]]:
    """Make the log end at the loaded state's ``step``: drop a torn line and the lines of later
    steps (a state since moved away or found damaged), and append ``last`` (the loaded state's own
    line, when the kill fell between the save and the append). Rewritten atomically, only if it
    changes; returns the records."""
    path = pathlib.Path(path)
    records = [r for r in read_log(path) if r[key] <= step]
    if last is not None and (not records or records[-1][key] != step):
        records.append(last)
    data = b"".join((json.dumps(r, sort_keys=True, allow_nan=False) + "\n").encode() for r in records)
    if (path.exists() or data) and (not path.exists() or path.read_bytes() != data):
        atomic_write(*filesystem(path), data)
    return records


@contextlib.contextmanager
def stop_requests() -> Iterator[Callable[[], bool]]:
    """While inside, the first SIGINT or SIGTERM (main thread only) asks the loop to stop at the next
    step boundary, where it saves; a second SIGINT interrupts at once. Handlers restored on exit.
    Yields ``requested() -> bool``."""
    requested = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield requested.is_set
        return

    def handle(signum, frame):
        if requested.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        requested.set()

    previous = {number: signal.signal(number, handle) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield requested.is_set
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


class CampaignClock:
    """CPU and wall seconds of a campaign over all its runs: the saved totals plus this run's
    (``time.process_time``: every thread of this process, JAX's included)."""

    def __init__(self, cpu_seconds: float = 0.0, wall_seconds: float = 0.0):
        self._cpu, self._wall = float(cpu_seconds), float(wall_seconds)
        self._cpu_began, self._wall_began = time.process_time(), time.monotonic()

    @property
    def cpu_seconds(self) -> float:
        return round(self._cpu + time.process_time() - self._cpu_began, 3)

    @property
    def wall_seconds(self) -> float:
        return round(self._wall + time.monotonic() - self._wall_began, 3)

    def running_for(self) -> float:
        """Wall seconds of this run alone."""
        return time.monotonic() - self._wall_began
