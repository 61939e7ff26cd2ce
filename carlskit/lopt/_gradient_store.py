"""``GradientStore``: the distributed dictionary between ES workers and the learner (Metz et al. 2020,
Appendix H.1). A Dask actor in cluster mode, a plain (thread-safe) object in-process.

A *gradient record* is a dict: ``id`` (unique str), ``grad`` (list of arrays, the flattened
meta-parameter leaves), ``outer_step`` (the learner step whose meta-parameters it was computed
at), ``task_family`` (str), ``losses`` (the ``[N, 2]`` antithetic pair losses), ``outer_loss``
(float), ``nan_fraction`` (float, the pairs that diverged), ``worker`` (int) and ``seconds``
(time the estimate took). :func:`carlskit.lopt._outer.worker_estimate` makes them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from carlskit._checks import positive_int

RECORD_FIELDS = ("id", "grad", "outer_step", "task_family", "losses", "outer_loss", "nan_fraction", "worker",
                 "seconds")


def call(target: Any, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
    """``target.method(*args)`` for a local object or a Dask actor handle (waits for the result)."""
    result = getattr(target, method)(*args, **kwargs)
    from distributed.actor import BaseActorFuture

    return result.result(timeout) if isinstance(result, BaseActorFuture) else result


class GradientStore:
    """Batched puts and takes of gradient records, keyed by their unique ``id``, oldest first.

    Args:
      max_records: records kept at most; beyond it the oldest are dropped and counted (a learner
        that fell behind would discard them as stale anyway).
    """

    def __init__(self, max_records: int = 10_000) -> None:
        self.max_records = positive_int(max_records, "max_records")
        self._records: OrderedDict[str, dict] = OrderedDict()
        self._lock = threading.Lock()
        self.puts = self.takes = self.overflowed = self.duplicates = 0

    def put_many(self, records: list[dict]) -> int:
        """Store ``records`` (each a dict with a str ``id``); returns how many were new.

        The whole list is checked first: one malformed record raises ``TypeError`` and stores none."""
        if not isinstance(records, (list, tuple)):
            raise TypeError(f"records must be a list of dicts, got {type(records).__name__}")
        for index, record in enumerate(records):
            if not isinstance(record, dict) or not isinstance(record.get("id"), str):
                shown = type(record).__name__ if not isinstance(record, dict) else f"id {record.get('id')!r}"
                raise TypeError(f"records[{index}]: each record must be a dict with a str 'id', got {shown}")
        added = 0
        with self._lock:
            for record in records:
                if record["id"] in self._records:
                    self.duplicates += 1
                    continue
                self._records[record["id"]] = record
                added += 1
            while len(self._records) > self.max_records:
                self._records.popitem(last=False)
                self.overflowed += 1
            self.puts += added
        return added

    def take_many(self, max_records: int) -> list[dict]:
        """Remove and return up to ``max_records`` records, oldest first."""
        max_records = positive_int(max_records, "max_records")
        with self._lock:
            count = min(max_records, len(self._records))
            taken = [self._records.popitem(last=False)[1] for _ in range(count)]
            self.takes += count
        return taken

    def size(self) -> int:
        return len(self._records)

    def status(self) -> dict[str, int]:
        with self._lock:
            return {"pending": len(self._records), "puts": self.puts, "takes": self.takes,
                    "overflowed": self.overflowed, "duplicates": self.duplicates}
