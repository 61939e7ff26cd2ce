"""``Maker``: asynchronous knowledge makers (CARLS paper section 3.1).

A maker loops until stopped: when the trainer has published a checkpoint newer than the one it
used last, it loads it, recomputes knowledge for its slice of the items and writes it to the bank
with the checkpoint's version. With a Dask client each slice runs as a long-running task on a
worker (it secedes from the worker's thread pool, so it never blocks other tasks or actors); without
one, slices run in threads of this process. A slice that raises is restarted; its error is kept in
``maker.errors``, logged, and printed, never swallowed. A slice whose worker dies is rerun by Dask
on another worker.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from carlskit.cluster._supervised import LongRunningTasks, secede_if_on_worker, stop_flag
from carlskit.training._checkpoint import CheckpointStore, restore_model
from carlskit._checks import positive_float, positive_int

logger = logging.getLogger("carlskit.makers")

MakerFn = Callable[["MakerContext"], None]


@dataclass
class MakerContext:
    """What a maker function receives for one round: the checkpoint, its items, the bank."""

    items: np.ndarray
    version: int
    checkpoint: dict[str, np.ndarray]
    metadata: dict
    bank: Any
    slice_index: int

    def restore_model(self, model, prefix: str = "model") -> None:
        """Load the checkpoint's ``prefix`` subtree (the trainer's model state) into ``model``."""
        restore_model(model, self.checkpoint, self.metadata, prefix)


def _report(topic: str, message: dict) -> None:
    """Send a status message to the client (Dask event) or keep it in-process (threads)."""
    try:
        from distributed import get_worker

        get_worker().log_event(topic, message)
    except ValueError:  # not on a worker: embedded mode
        _LOCAL_EVENTS.setdefault(topic, []).append((time.time(), message))


_LOCAL_EVENTS: dict[str, list] = {}


def run_maker_slice(fn: MakerFn, items: np.ndarray, slice_index: int, store_path: str, bank: Any,
                    stop: Any, topic: str, poll_seconds: float, max_rounds: int | None) -> int:
    """The loop one slice runs (on a worker or a thread) until ``stop`` is set; returns rounds run."""
    secede_if_on_worker()  # runs for as long as training does; in thread mode there is no slot to free
    store = CheckpointStore(store_path, keep=None)
    current, rounds = None, 0
    while not stop.is_set() and (max_rounds is None or rounds < max_rounds):
        latest = store.latest()
        if latest is None or latest == current:
            time.sleep(poll_seconds)
            continue
        start = time.perf_counter()
        try:
            checkpoint, metadata = store.load(latest)
        except FileNotFoundError:  # pruned between latest() and load(): take the next one
            continue
        if fn(MakerContext(items, latest, checkpoint, metadata, bank, slice_index)) is False:
            time.sleep(poll_seconds)  # its inputs are not in the bank yet: retry this version
            continue
        seconds = time.perf_counter() - start
        current, rounds = latest, rounds + 1
        _report(topic, {"slice": slice_index, "version": latest, "items": len(items),
                        "seconds": seconds, "round": rounds})
    return rounds


class Maker:
    """Run ``fn`` over slices of ``items`` whenever a newer checkpoint is published.

    Args:
      fn: ``fn(context: MakerContext)``; computes knowledge for ``context.items`` from
        ``context.checkpoint`` (leaves by path) and writes it with
        ``context.bank.update(..., version=context.version)``. Returning ``False`` says its inputs
        are not ready yet (e.g. embeddings another maker writes): the round is retried.
      items: the item keys this maker is responsible for (split into ``num_slices`` slices).
      num_slices: parallel slices (one Dask task or thread each).
      name: shown in status and events.
      poll_seconds: how often a slice checks for a new checkpoint.
      workers: optional Dask worker addresses (or resource restrictions) the slices may run on.
    """

    def __init__(self, fn: MakerFn, items: np.ndarray, *, num_slices: int = 1, name: str | None = None,
                 poll_seconds: float = 0.2, workers: list[str] | None = None, max_restarts: int = 10):
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        items = np.asarray(items)
        if items.ndim != 1 or not np.issubdtype(items.dtype, np.integer) or len(items) == 0:
            raise ValueError(f"items must be a non-empty 1-D int array, got {items.dtype} {items.shape}")
        if positive_int(num_slices, "num_slices") > len(items):
            raise ValueError(f"num_slices must be in [1, {len(items)}] (one item per slice at least), got {num_slices}")
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a str or None, got {type(name).__name__}")
        self.fn = fn
        self.items = items.astype(np.int64)
        self.num_slices = int(num_slices)
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        self.poll_seconds = positive_float(poll_seconds, "poll_seconds")
        self.workers = workers
        self.max_restarts = max_restarts
        self._topic = f"carlskit-maker-{self.name}-{uuid.uuid4().hex[:8]}"
        self._client = None
        self._store: CheckpointStore | None = None
        self._stop = None
        self._tasks: LongRunningTasks | None = None  # the slices, supervised (restarted on failure)
        self._past_errors: list[tuple[str, str]] = []
        self._past_restarts = 0
        self._fn_ref: Any = None  # fn, or its Future on the cluster while running
        self._started = 0.0

    @property
    def errors(self) -> list[tuple[str, str]]:
        """``(slice, message with traceback)`` of every failure, over all runs of this maker."""
        return self._past_errors + (self._tasks.errors if self._tasks is not None else [])

    @property
    def restarts(self) -> int:
        return self._past_restarts + (self._tasks.restarts if self._tasks is not None else 0)

    @property
    def slices(self) -> list[np.ndarray]:
        return np.array_split(self.items, self.num_slices)

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, checkpoints: CheckpointStore, bank: Any, client: Any = None) -> Maker:
        """Start every slice; returns self. ``client=None`` runs slices in threads here."""
        if self._tasks is not None:
            raise RuntimeError(f"maker {self.name!r} is already running")
        if not isinstance(checkpoints, CheckpointStore):
            raise TypeError(f"checkpoints must be a CheckpointStore, got {type(checkpoints).__name__}")
        self._topic = f"carlskit-maker-{self.name}-{uuid.uuid4().hex[:8]}"  # this run's events only
        self._store, self._bank, self._client = checkpoints, bank, client
        self._started = time.time()
        self._stop = stop_flag(client, f"{self._topic}-stop")
        # Ship fn (and the features it may hold) to the cluster once, not with every slice and restart.
        self._fn_ref = self.fn if client is None else client.scatter(self.fn, hash=False)
        self._tasks = LongRunningTasks(client, f"maker-{self.name}", piece="slice", policy=self.max_restarts)
        for index in range(self.num_slices):
            # Preferred workers; a slice whose worker is lost is rerun elsewhere.
            self._tasks.launch(str(index), run_maker_slice, self._slice_arguments(index), workers=self.workers)
        return self

    def _slice_arguments(self, index: int):
        return lambda: (self._fn_ref, self.slices[index], index, self._store.path, self._bank, self._stop,
                        self._topic, self.poll_seconds, None)

    def wait_for_version(self, version: int, timeout: float = 120.0) -> None:
        """Block until every slice has written knowledge for ``version`` or newer.

        Raises ``TimeoutError`` (with the maker's errors, if any) when that takes over ``timeout`` s.
        """
        deadline = time.monotonic() + timeout
        while True:
            versions = [s["version"] for s in self.status()["slices"]]
            if all(v is not None and v >= version for v in versions):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"maker {self.name!r} slices reached versions {versions}, not {version}, "
                                   f"within {timeout:g} s; errors: {[e for _, e in self.errors][:1]}")
            time.sleep(0.05)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop every slice and wait for them to end."""
        if self._tasks is None:
            return
        self._tasks.stop(self._stop, timeout)
        self._past_errors, self._past_restarts = self.errors, self.restarts
        self._tasks = None
        self._fn_ref = None

    # -- status ----------------------------------------------------------------------------------
    def events(self) -> list[dict]:
        if self._client is None:
            return [message for _, message in _LOCAL_EVENTS.get(self._topic, [])]
        return [message for _, message in self._client.get_events(self._topic)]

    def status(self) -> dict:
        """Per-slice version, lag (checkpoints published since), items/s; plus restarts and errors."""
        events = self.events()
        published = self._store.versions() if self._store is not None else []
        latest_by_slice: dict[int, dict] = {}
        for message in events:
            latest_by_slice[message["slice"]] = message
        slices = []
        for index in range(self.num_slices):
            message = latest_by_slice.get(index)
            version = None if message is None else message["version"]
            slices.append({
                "slice": index,
                "version": version,
                "lag": len(published) if version is None else sum(v > version for v in published),
                "items_per_s": None if message is None else message["items"] / max(message["seconds"], 1e-9),
                "rounds": 0 if message is None else message["round"],
            })
        return {"name": self.name, "slices": slices, "restarts": self.restarts,
                "errors": [e for _, e in self.errors]}

    def __repr__(self) -> str:
        status = self.status()
        versions = [s["version"] for s in status["slices"]]
        return (f"<Maker {self.name!r}: {self.num_slices} slice(s), versions {versions}, "
                f"restarts {status['restarts']}, errors {len(status['errors'])}>")
