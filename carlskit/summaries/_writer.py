"""``SummaryWriter``: batched, sampled summary logging, direct to files or through sharded aggregators.

Metz et al. 2022 (learned optimizers at scale), Appendix H.1: training workers send summaries in
batched calls to aggregator services sharded by summary name, log stochastically (``sample_rate``)
and keep subsampled copies for fast plotting.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import math
import os
import threading
import time
import weakref
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from carlskit.summaries import _format
from carlskit.summaries._files import Batch, SummaryFiles, new_origin


def shard_of(name: str, n_shards: int) -> int:
    """Stable shard of a summary name: ``crc32(utf8(name)) mod n_shards`` (same in every process,
    unlike Python's salted ``hash``)."""
    return zlib.crc32(name.encode("utf-8")) % n_shards


class SummaryAggregator:
    """A Dask actor owning one shard: appends the batches it receives to its own files.

    Created by :class:`SummaryWriter` (one per shard, spread over the workers); not used directly.
    """

    def __init__(self, logdir: str, shard: int):
        self.shard = shard
        self._files = SummaryFiles(logdir, new_origin(f"shard{shard:03d}"))

    def append(self, batches: list[Batch]) -> int:
        return self._files.append(batches)

    def flush_to_disk(self) -> None:
        self._files.flush_to_disk()

    def close(self) -> None:
        self._files.close()

    def status(self) -> dict[str, Any]:
        return {"shard": self.shard, "origin": self._files.origin,
                "records": self._files.records_written, "entries": self._files.entries_written}


_open_writers: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _flush_open_writers() -> None:
    for writer in list(_open_writers):
        with contextlib.suppress(Exception):  # interpreter shutdown: best effort only
            writer.close()


def _check_rate(sample_rate: float, argument: str = "sample_rate") -> float:
    rate = float(sample_rate)
    if not 0.0 <= rate <= 1.0 or math.isnan(rate):
        raise ValueError(f"{argument} must be in [0, 1], got {sample_rate!r}")
    return rate


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if len(name.encode("utf-8")) >= 2**16:
        raise ValueError("name must be shorter than 65536 bytes in UTF-8")
    return name


def _step_of(kind: str, name: str, step: Any) -> int:
    """``int(step)``, or ``TypeError`` naming the summary: called before anything is buffered."""
    try:
        return int(step)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{kind} {name!r}: step must be an int, got {step!r} ({error})") from None


class SummaryWriter:
    """Log scalars, arrays and text; batched in this process and written by a background thread.

    Without a client, the writer appends to its own files in ``logdir``. With a Dask client it
    starts one :class:`SummaryAggregator` actor per shard (default: one per worker), and each flush
    sends every shard *one* call carrying all pending summaries whose name hashes to it
    (:func:`shard_of`); each aggregator appends to its own files. ``logdir`` must then be a path
    every worker sees (a local or shared file system).

    Stochastic logging (H.1): each call is kept with probability ``sample_rate`` (the writer's, or
    the call's own), drawn from a generator seeded by ``seed``.

    The writer pickles: a copy sent to a Dask task logs through the same aggregators (or, without a
    client, to its own files); closing that copy flushes it and leaves the aggregators running.
    A copy samples from fresh entropy, not from ``seed``. Points still buffered in a writer that is
    garbage-collected without :meth:`close` are lost (open writers are closed at interpreter exit).
    Use it as a context manager or call :meth:`close`; :meth:`flush` blocks until everything logged
    so far is in the files.

    Args:
      logdir: directory of the summary files (created if missing).
      client: a ``distributed.Client``; ``None`` writes directly.
      sample_rate: default probability of keeping a call, in [0, 1].
      flush_every_seconds: period of the background flush.
      seed: seed of the sampling generator.
      n_shards: number of aggregators (client mode); default the number of workers.
      max_pending: pending entries that wake the flush thread early (bounds memory).
    """

    def __init__(
        self,
        logdir: str | os.PathLike,
        *,
        client: Any = None,
        sample_rate: float = 1.0,
        flush_every_seconds: float = 1.0,
        seed: int | None = 0,
        n_shards: int | None = None,
        max_pending: int = 1_000_000,
        _aggregators: list | None = None,
    ):
        if not isinstance(logdir, (str, os.PathLike)):
            raise TypeError(f"logdir must be a path, got {type(logdir).__name__}")
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.sample_rate = _check_rate(sample_rate)
        if not flush_every_seconds > 0:
            raise ValueError(f"flush_every_seconds must be > 0, got {flush_every_seconds!r}")
        self.flush_every_seconds = float(flush_every_seconds)
        if not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending must be a positive int, got {max_pending!r}")
        self.max_pending = max_pending
        self._seed = seed
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()  # guards the buffers and the generator
        self._flush_lock = threading.Lock()  # one flush at a time keeps batches in order
        self._scalars: dict[str, tuple[list, list, list]] = {}
        self._others: dict[tuple[int, str], list] = {}
        self._pending = 0
        self._error: BaseException | None = None
        self._closed = False
        self._client = client
        self._aggregator_futures: list = []
        self._files: SummaryFiles | None = None
        if _aggregators is not None:  # a copy unpickled in another process
            self._aggregators = list(_aggregators)
            self._owns_aggregators = False
        elif client is not None:
            self._aggregators = self._start_aggregators(client, n_shards)
            self._owns_aggregators = True
        else:
            self._aggregators = []
            self._owns_aggregators = False
        if not self._aggregators:
            self._files = SummaryFiles(self.logdir, new_origin("writer"))
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None  # started by the first logging call
        _open_writers.add(self)

    # -- aggregators ---------------------------------------------------------------------------
    def _start_aggregators(self, client, n_shards: int | None) -> list:
        workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
        if n_shards is None:
            n_shards = max(1, len(workers))
        if not isinstance(n_shards, int) or n_shards < 1:
            raise ValueError(f"n_shards must be a positive int, got {n_shards!r}")
        logdir = str(self.logdir.resolve())
        self._aggregator_futures = [
            client.submit(
                SummaryAggregator, logdir, shard, actor=True, pure=False,
                workers=[workers[shard % len(workers)]] if workers else None,
                allow_other_workers=True,
            )
            for shard in range(n_shards)
        ]
        return [future.result() for future in self._aggregator_futures]

    @property
    def n_shards(self) -> int:
        return max(1, len(self._aggregators))

    def __reduce__(self):
        aggregators = self._aggregators or None
        return (_rebuild_writer, (str(self.logdir), aggregators, self.sample_rate,
                                  self.flush_every_seconds, self.max_pending))

    def _start_flush_thread(self) -> None:
        """Start the background flush in a copy of the caller's context: inside a Dask task that
        context names the worker, which actor calls from the thread need."""
        with self._lock:
            if self._thread is not None or self._closed:
                return
            self._thread = threading.Thread(
                target=contextvars.copy_context().run,
                args=(_flush_loop, weakref.ref(self), self._wake, self._stop),
                name="carlskit-summary-flush", daemon=True,
            )
            self._thread.start()

    # -- logging -------------------------------------------------------------------------------
    def _keep(self, sample_rate: float | None) -> bool:
        rate = self.sample_rate if sample_rate is None else _check_rate(sample_rate)
        return rate >= 1.0 or self._rng.random() < rate

    def scalar(self, name: str, value: float, step: int, *, sample_rate: float | None = None) -> bool:
        """Log one scalar; return whether it was kept by sampling. Costs about a microsecond."""
        if self._closed:
            raise RuntimeError("SummaryWriter is closed")
        if self._thread is None:
            self._start_flush_thread()
        try:
            value, step = float(value), int(step)
        except (TypeError, ValueError) as error:
            raise TypeError(f"scalar {name!r}: value must be a number and step an int ({error})") from None
        wall_time = time.time()
        with self._lock:
            if not self._keep(sample_rate):
                return False
            buffer = self._scalars.get(name)
            if buffer is None:
                buffer = self._scalars[_check_name(name)] = ([], [], [])
            buffer[0].append(step)
            buffer[1].append(wall_time)
            buffer[2].append(value)
            self._pending += 1
            if self._pending >= self.max_pending:
                self._wake.set()
        return True

    def scalars(self, name: str, values: Any, steps: Any, *, sample_rate: float | None = None) -> int:
        """Log many points of one scalar at once (1-D ``values`` and ``steps`` of equal length);
        return how many were kept."""
        if self._closed:
            raise RuntimeError("SummaryWriter is closed")
        if self._thread is None:
            self._start_flush_thread()
        _check_name(name)
        values = np.asarray(values, dtype=np.float64).reshape(-1)
        steps = np.asarray(steps)
        if steps.shape != values.shape or not np.issubdtype(steps.dtype, np.integer):
            raise ValueError(
                f"steps must be integers of shape {values.shape} like values, got {steps.dtype} {steps.shape}"
            )
        rate = self.sample_rate if sample_rate is None else _check_rate(sample_rate)
        wall_time = time.time()
        with self._lock:
            if rate < 1.0:
                keep = self._rng.random(values.size) < rate
                values, steps = values[keep], steps[keep]
            buffer = self._scalars.setdefault(name, ([], [], []))
            buffer[0].extend(steps.astype(np.int64).tolist())
            buffer[1].extend([wall_time] * values.size)
            buffer[2].extend(values.tolist())
            self._pending += values.size
            if self._pending >= self.max_pending:
                self._wake.set()
        return int(values.size)

    def array(
        self,
        name: str,
        values: Any,
        step: int,
        *,
        mode: str = "histogram",
        bins: int = 30,
        max_samples: int = 256,
        sample_rate: float | None = None,
    ) -> bool:
        """Log an array as a histogram (``mode="histogram"``, ``bins`` equal-width bins over its
        finite range) or as a uniform random subsample of at most ``max_samples`` elements
        (``mode="samples"``)."""
        if self._closed:
            raise RuntimeError("SummaryWriter is closed")
        if self._thread is None:
            self._start_flush_thread()
        _check_name(name)
        step = _step_of("array", name, step)
        flat = np.asarray(values, dtype=np.float64).reshape(-1)
        if mode == "histogram":
            if not isinstance(bins, int) or bins < 1:
                raise ValueError(f"bins must be a positive int, got {bins!r}")
            finite = flat[np.isfinite(flat)]
            counts, edges = np.histogram(finite, bins=bins) if finite.size else (
                np.zeros(bins), np.linspace(0.0, 1.0, bins + 1))
            entry, kind = (bins, edges.astype(np.float64), counts.astype(np.float64)), _format.HISTOGRAMS
        elif mode == "samples":
            if not isinstance(max_samples, int) or max_samples < 1:
                raise ValueError(f"max_samples must be a positive int, got {max_samples!r}")
            kind = _format.SAMPLES
        else:
            raise ValueError(f"mode must be 'histogram' or 'samples', got {mode!r}")
        wall_time = time.time()
        with self._lock:
            if not self._keep(sample_rate):
                return False
            if kind == _format.SAMPLES:
                if flat.size > max_samples:
                    chosen = np.sort(self._rng.choice(flat.size, size=max_samples, replace=False))
                    entry = (flat.size, flat[chosen])
                else:
                    entry = (flat.size, flat.copy())
            self._others.setdefault((kind, name), []).append((step, wall_time, entry))
            self._pending += 1
        return True

    def text(self, name: str, text: str, step: int, *, sample_rate: float | None = None) -> bool:
        """Log a string."""
        if self._closed:
            raise RuntimeError("SummaryWriter is closed")
        if self._thread is None:
            self._start_flush_thread()
        _check_name(name)
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        step = _step_of("text", name, step)
        wall_time = time.time()
        with self._lock:
            if not self._keep(sample_rate):
                return False
            self._others.setdefault((_format.TEXTS, name), []).append(
                (step, wall_time, text.encode("utf-8")))
            self._pending += 1
        return True

    # -- flushing ------------------------------------------------------------------------------
    def _take_batches(self) -> list[Batch]:
        with self._lock:
            scalars, self._scalars = self._scalars, {}
            others, self._others = self._others, {}
            self._pending = 0
        batches: list[Batch] = []
        for name, (steps, wall_times, values) in scalars.items():
            if not steps:
                continue
            batches.append((_format.SCALARS, name, len(steps), [
                np.array(steps, dtype=np.int64), np.array(wall_times, dtype=np.float64),
                np.array(values, dtype=np.float64)]))
        for (kind, name), entries in others.items():
            if not entries:  # nothing was appended (never expected; one empty list must not cost the rest)
                continue
            batches.append((kind, name, len(entries), _columns_of(kind, entries)))
        return batches

    def _flush_once(self) -> None:
        with self._flush_lock:
            batches = self._take_batches()
            if not batches:
                return
            if self._files is not None:
                self._files.append(batches)
                return
            per_shard: dict[int, list[Batch]] = {}
            for batch in batches:
                per_shard.setdefault(shard_of(batch[1], len(self._aggregators)), []).append(batch)
            calls = [self._aggregators[shard].append(part) for shard, part in per_shard.items()]
            for call in calls:
                call.result()

    def _background_flush(self) -> None:
        try:
            self._flush_once()
        except BaseException as error:  # surfaced by the next flush() or close()
            self._error = error

    def _raise_background_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"background summary flush failed: {error!r}") from error

    def flush(self) -> None:
        """Write everything logged so far; return once it is in the files (or the aggregators'
        files). Raises if a background flush failed."""
        self._raise_background_error()
        self._flush_once()

    def close(self) -> None:
        """Flush, stop the background thread and, for the writer that started them, close the
        aggregators (their files are closed and synced). Idempotent."""
        if self._closed:
            return
        self._stop.set()
        self._wake.set()
        if self._thread is not None and threading.current_thread() is not self._thread:
            self._thread.join()
        try:
            self.flush()
        finally:
            self._closed = True
            _open_writers.discard(self)
            if self._files is not None:
                self._files.close()
            if self._owns_aggregators:
                calls = [aggregator.close() for aggregator in self._aggregators]
                for call in calls:
                    call.result()
                for future in self._aggregator_futures:
                    future.release()
                self._aggregator_futures = []

    def __enter__(self) -> SummaryWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        where = f"{len(self._aggregators)} aggregators" if self._aggregators else "direct"
        state = "closed" if self._closed else "open"
        return f"SummaryWriter({str(self.logdir)!r}, {where}, sample_rate={self.sample_rate:g}, {state})"


def _columns_of(kind: int, entries: list) -> list[np.ndarray]:
    steps = np.array([entry[0] for entry in entries], dtype=np.int64)
    wall_times = np.array([entry[1] for entry in entries], dtype=np.float64)
    payloads = [entry[2] for entry in entries]
    if kind == _format.HISTOGRAMS:
        bins = np.array([payload[0] for payload in payloads], dtype=np.uint32)
        data = np.concatenate([np.concatenate([edges, counts]) for _, edges, counts in payloads])
        return [steps, wall_times, bins, data]
    if kind == _format.SAMPLES:
        sizes = np.array([payload[0] for payload in payloads], dtype=np.uint64)
        lengths = np.array([payload[1].size for payload in payloads], dtype=np.uint32)
        return [steps, wall_times, sizes, lengths, np.concatenate([payload[1] for payload in payloads])]
    lengths = np.array([len(payload) for payload in payloads], dtype=np.uint32)
    return [steps, wall_times, lengths, np.frombuffer(b"".join(payloads), dtype=np.uint8)]


def _flush_loop(writer_ref, wake: threading.Event, stop: threading.Event) -> None:
    while not stop.is_set():
        writer = writer_ref()
        if writer is None:
            return
        period = writer.flush_every_seconds
        del writer  # hold no strong reference while sleeping, so an abandoned writer is collected
        wake.wait(period)
        wake.clear()
        if stop.is_set():
            return
        writer = writer_ref()
        if writer is None:
            return
        writer._background_flush()
        del writer


def _rebuild_writer(logdir, aggregators, sample_rate, flush_every_seconds, max_pending):
    writer = SummaryWriter(logdir, sample_rate=sample_rate, flush_every_seconds=flush_every_seconds,
                           seed=None, max_pending=max_pending, _aggregators=aggregators)
    return writer

