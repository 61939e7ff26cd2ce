"""Input pipeline: batches enriched with knowledge from the bank, prefetched in a background thread."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

from carlskit._checks import positive_int
from carlskit._transfers import steady_state

Batch = dict[str, Any]

_DONE = object()


class Prefetcher:
    """Run ``source`` and ``knowledge`` in a background thread, ``depth`` batches ahead of training.

    ``source()`` returns the next batch (a dict of numpy arrays) or raises ``StopIteration``;
    ``knowledge(batch)`` (optional) returns the batch with knowledge added (bank lookups), so the
    bank's latency overlaps the previous training step. Errors in the thread are re-raised by
    ``next()`` in the training thread, never swallowed.
    """

    def __init__(self, source: Callable[[], Batch], knowledge: Callable[[Batch], Batch] | None = None,
                 depth: int = 2):
        depth = positive_int(depth, "depth")
        self._source = source
        self._knowledge = knowledge
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="carlskit-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        made = 0
        try:
            while not self._stop.is_set():
                # the transfer guard of the training steps holds here too (its thread's own setting)
                with steady_state(warm=made > 0):
                    try:
                        batch = self._source()
                    except StopIteration:
                        break
                    if self._knowledge is not None:
                        batch = self._knowledge(batch)
                made += 1
                if not self._put(batch):
                    return
        except BaseException as error:  # handed to the consumer, which re-raises it
            self._put(error)
            return
        self._put(_DONE)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        item = self._queue.get()
        if item is _DONE:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
