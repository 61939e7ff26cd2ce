"""``SummaryWriter``: batched, sampled summary logging, direct to files or through sharded aggregators.

Metz et al. 2020 ("Tasks, stability, architecture, and compute"), Appendix H.1: training workers send summaries in
batched calls to aggregator services sharded by summary name, log stochastically (``sample_rate``)
and keep subsampled copies for fast plotting.

Delivery (issue 14): the writer keeps every batch of a shard until that shard's aggregator has
acknowledged it (the acknowledgement is sent after the batch is in the aggregator's file). When an
aggregator's worker dies, the writer rebuilds that aggregator on a live worker, under the
service kit of :mod:`carlskit.cluster` (``summaries/_delivery.py``), and re-sends the batches it
holds; the other shards are neither stopped nor re-sent to. A batch that was written but whose
acknowledgement was lost with the worker is therefore written twice; every record carries the
writer's id and the batch's sequence number, and :class:`~carlskit.summaries.SummaryReader` keeps
one copy. The guarantee is at-least-once into the files and exactly-once as read.

The writer pickles: a copy sent to a Dask task logs through the same aggregators (or, without a
client, to its own files); closing that copy flushes it and leaves the aggregators running. A copy
that finds an aggregator lost creates its own replacement (closed with the copy). A copy samples
from fresh entropy, not from ``seed``. Points still buffered in a writer that is garbage-collected
without :meth:`~SummaryWriter.close` are lost (open writers are closed at interpreter exit).

What a SIGKILL of the logging process loses (issue 43): a logging call that finds the last completed
flush more than ``flush_every_seconds`` old writes the buffers itself before it returns, after any
flush in progress (:func:`_flush_if_overdue`). So once a call that began ``flush_every_seconds``
after a point was logged has returned, the point is in the files (acknowledged by its aggregator,
with a client): a SIGKILL loses at most the points logged in the last ``flush_every_seconds`` plus
one flush's duration, however busy the logging loop keeps the GIL. While a shard is recovering, a
write fails or a flush takes over ``OVERDUE_WAIT_SECONDS``, calls leave the flushing to the background.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import math
import os
import secrets
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from carlskit import _checks
from carlskit._errors import ServiceGaveUpError
from carlskit.cluster import Placement, RestartPolicy, restart_policy
from carlskit.summaries import _format
from carlskit.summaries._delivery import (
    CALL_TIMEOUT_SECONDS,
    MAX_SHARDS,
    Delivery,
    SummaryAggregator,
    SummaryAggregatorError,
    aggregator_of,
    take_batches,
)

__all__ = ["SummaryWriter", "SummaryAggregator", "SummaryAggregatorError", "aggregator_of", "CALL_TIMEOUT_SECONDS"]

#: Upper bounds of size arguments: a typo (``bins=10**9``) is a clear ``ValueError`` here, never a
#: ``MemoryError`` in a background thread. ``max_pending`` entries cost about 100 bytes each.
MAX_PENDING_LIMIT = 100_000_000
MAX_BINS = 65_536
MAX_SAMPLES = 1 << 20
MAX_TEXT_BYTES = (1 << 31) - 1  # lengths are u32 in the file format
#: A logging call that finds the flush overdue waits at most this long for a flush in progress (then
#: logs on, leaving a stuck flush, e.g. a hung aggregator, to the background thread).
OVERDUE_WAIT_SECONDS = 10.0


_open_writers: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _flush_open_writers() -> None:
    for writer in list(_open_writers):
        with contextlib.suppress(Exception):  # interpreter shutdown: best effort only
            writer.close()


def _check_rate(sample_rate: float, argument: str = "sample_rate") -> float:
    rate = _checks.finite_float(sample_rate, argument)
    if not 0.0 <= rate <= 1.0 or math.isnan(rate):
        raise ValueError(f"{argument} must be in [0, 1], got {sample_rate!r}")
    return rate


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if len(_checks.utf8(name, "name")) >= 2**16:
        raise ValueError("name must be shorter than 65536 bytes in UTF-8")
    return name


def _check_steps(steps: Any, shape: tuple[int, ...]) -> np.ndarray:
    """``steps`` as int64 of ``shape`` (``scalars``' values'), or ValueError naming them."""
    try:
        steps = np.asarray(steps)
    except (ValueError, TypeError) as error:
        raise ValueError(f"steps must be integers of shape {shape} like values, got a ragged or "
                         f"unconvertible {type(steps).__name__}") from error
    if steps.shape != shape or steps.dtype.kind not in "iu":
        raise ValueError(f"steps must be integers of shape {shape} like values, got {steps.dtype} {steps.shape}")
    if steps.dtype.kind == "u" and steps.size and int(steps.max()) > _checks.INT64_MAX:
        raise ValueError(f"steps must fit in int64, got a step of {int(steps.max())}")
    return steps.astype(np.int64)


def _array_entry(flat: np.ndarray, kind: int, bins: int, max_samples: int, rng: np.random.Generator) -> tuple:
    """What ``array`` logs of ``flat``: ``(bins, edges, counts)`` of the histogram of its finite
    values, or ``(size, subsample)`` of at most ``max_samples`` elements drawn with ``rng``."""
    if kind == _format.HISTOGRAMS:
        finite = flat[np.isfinite(flat)]
        counts, edges = np.histogram(finite, bins=bins) if finite.size else (
            np.zeros(bins), np.linspace(0.0, 1.0, bins + 1))
        return bins, edges.astype(np.float64), counts.astype(np.float64)
    if flat.size > max_samples:
        return flat.size, flat[np.sort(rng.choice(flat.size, size=max_samples, replace=False))]
    return flat.size, flat.copy()


def _value_of(name: str, value: Any) -> float:
    """``float(value)`` for a real number (Python, numpy or a 0-d JAX array), never a string."""
    if type(value) is float:
        return value
    if isinstance(value, (str, bytes)):
        raise TypeError(f"scalar {name!r}: value must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError) as error:
        raise TypeError(f"scalar {name!r}: value must be a number, got {value!r} ({error})") from None


class SummaryWriter:
    """Log scalars, arrays and text; batched in this process and written by a background thread.

    Without a client, the writer appends to its own files in ``logdir``. With a Dask client it
    starts one :class:`SummaryAggregator` actor per shard (default: one per worker), and each flush
    sends every shard *one* call carrying all pending summaries whose name hashes to it
    (:func:`aggregator_of`); each aggregator appends to its own files. ``logdir`` must then be a path
    every worker sees (a local or shared file system).

    Lost aggregators (:mod:`carlskit.summaries._delivery`, on the service kit of
    :mod:`carlskit.cluster`): each shard's batches are held until its aggregator acknowledges them;
    an aggregator whose worker is lost is rebuilt on a live worker with backoff (``restart_policy``)
    and the held batches are re-sent (no point lost; a repeat is dropped by readers), while the
    other shards keep flushing. A spent restart budget raises :class:`carlskit.ServiceGaveUpError`
    at the next call; an aggregator's own failure (e.g. a full disk) raises
    :class:`SummaryAggregatorError` and the batch is re-sent. :meth:`status` shows every shard.

    Backpressure: at most ``max_pending`` entries are held (buffered plus sent but not
    acknowledged). A logging call that finds the bound reached blocks until acknowledgements make
    room, at most ``block_seconds`` (then ``TimeoutError``; ``None`` waits until room is made or the
    restart budget is spent).

    Stochastic logging (H.1): each call is kept with probability ``sample_rate`` (the writer's, or
    the call's own), drawn from a generator seeded by ``seed``. Copies (pickling) and closing: see
    the module docstring; so is what a SIGKILL loses (the last ``flush_every_seconds`` plus one
    flush). Use it as a context manager or call :meth:`close`; :meth:`flush` blocks
    until everything logged so far is in the files.

    Args:
      logdir: directory of the summary files (created if missing).
      client: a ``distributed.Client``; ``None`` writes directly.
      sample_rate: default probability of keeping a call, in [0, 1].
      flush_every_seconds: period of the background flush.
      seed: seed of the sampling generator.
      n_shards: number of aggregators (client mode); default the number of workers.
      max_pending: most entries held in memory (buffered or awaiting acknowledgement), at most
        ``MAX_PENDING_LIMIT``; a quarter of it wakes the flush thread early.
      block_seconds: longest a logging call waits for room (``None``: until room or give-up).
      restart_policy: :class:`carlskit.cluster.RestartPolicy` (or a budget in seconds) for
        recreating lost aggregators; default 10 minutes of retries.
      workers, resources: where the aggregators may run (:class:`carlskit.cluster.Placement`);
        kept when a lost aggregator is recreated. By default, off accelerator workers when there
        are others.
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
        block_seconds: float | None = None,
        restart_policy: RestartPolicy | float | None = None,
        workers: list[str] | str | None = None,
        resources: dict[str, float] | None = None,
    ):
        aggregators = _adopted_aggregators.get()  # set by _rebuild_writer only: the private constructor path
        _checks.path(logdir, "logdir")
        self.sample_rate = _check_rate(sample_rate)
        self.flush_every_seconds = _checks.positive_float(flush_every_seconds, "flush_every_seconds")
        self.max_pending = _checks.integer(max_pending, "max_pending", 1, MAX_PENDING_LIMIT)
        self.block_seconds = None if block_seconds is None else _checks.finite_float(
            block_seconds, "block_seconds", minimum=0.0)
        self.restart_policy = _restart_policy(restart_policy)
        self.placement = Placement.of(workers, resources)
        if client is None and aggregators is None and self.placement.restricted:
            raise ValueError("workers/resources place aggregators on a Dask cluster: pass a client too")
        if n_shards is not None:
            n_shards = _checks.integer(n_shards, "n_shards", 1, MAX_SHARDS)
        if seed is not None:  # a bool is not a seed (numpy would take True as 1)
            seed = _checks.integer(seed, "seed", 0)
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._wake_at = max(1, self.max_pending // 4)
        self._flush_due = time.monotonic() + self.flush_every_seconds  # see _flush_if_overdue
        self._seed = seed
        self._rng = np.random.default_rng(seed)
        self._writer_id = secrets.randbits(64)  # marks this object's batches (copies get their own)
        self._lock = threading.Lock()  # guards the buffers, the counters and the generator
        self._flush_lock = threading.RLock()  # one flush step at a time keeps batches in order
        self._room = threading.Event()  # set when acknowledgements free held entries
        self._scalars: dict[str, tuple[list, list, list]] = {}
        self._others: dict[tuple[int, str], list] = {}
        self._buffered = 0  # entries in the buffers
        self._held = 0  # entries buffered or awaiting acknowledgement (the backpressure bound)
        self._error: BaseException | None = None
        self._gave_up: str | None = None
        self._closed = False
        self._alarm = False  # closed, a background error or a give-up: checked by every call
        self._delivery = Delivery(self.logdir, self.restart_policy, self.placement, client, n_shards, aggregators,
                                  self._freed, self._give_up)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None  # started by the first logging call
        _open_writers.add(self)

    # -- aggregators ---------------------------------------------------------------------------
    @property
    def _shards(self) -> list:
        return self._delivery.shards

    @property
    def n_shards(self) -> int:
        return len(self._shards)

    @property
    def _aggregators(self) -> list:
        return self._delivery.aggregators

    def __reduce__(self):
        aggregators = self._aggregators or None
        return (_rebuild_writer, (str(self.logdir), aggregators, self.sample_rate,
                                  self.flush_every_seconds, self.max_pending, self.block_seconds,
                                  self.restart_policy, self.placement))

    # -- logging -------------------------------------------------------------------------------
    def _keep(self, sample_rate: float | None) -> bool:
        rate = self.sample_rate if sample_rate is None else _check_rate(sample_rate)
        return rate >= 1.0 or self._rng.random() < rate

    def _before_logging(self, entries: int = 1, began: float | None = None) -> None:
        """Raise what the background found (closed, error, give-up); wait for room if the bound
        is reached; start the flush thread; flush if overdue at ``began`` (``time.monotonic()``)."""
        if self._alarm:
            self._raise_alarm()
        if self._held + entries > self.max_pending and self._held > 0:
            self._wait_for_room(entries)
        if self._thread is None:
            _start_flush_thread(self)
        _flush_if_overdue(self, time.monotonic() if began is None else began)

    def scalar(self, name: str, value: float, step: int, *, sample_rate: float | None = None) -> bool:
        """Log one scalar; return whether it was kept by sampling. Costs about a microsecond.

        ``step`` must be an integer (Python or numpy, not bool) in the int64 range, checked here:
        a bad call raises and leaves every pending point as it was."""
        # The common case (open, room, flush not overdue, a float and an int): attribute checks, a clock read.
        began = time.monotonic()
        if self._alarm or self._held >= self.max_pending or self._thread is None or began > self._flush_due:
            self._before_logging(1, began)
        if type(value) is not float:
            value = _value_of(name, value)
        if type(step) is not int or not _checks.INT64_MIN <= step <= _checks.INT64_MAX:
            step = _checks.int64(step, "step")
        wall_time = time.time()
        with self._lock:
            if sample_rate is not None or self.sample_rate < 1.0:
                if not self._keep(sample_rate):
                    return False
            buffer = self._scalars.get(name)
            if buffer is None:
                buffer = self._scalars[_check_name(name)] = ([], [], [])
            buffer[0].append(step)
            buffer[1].append(wall_time)
            buffer[2].append(value)
            self._buffered += 1
            self._held += 1
            if self._buffered >= self._wake_at:
                self._wake.set()
        return True

    def scalars(self, name: str, values: Any, steps: Any, *, sample_rate: float | None = None) -> int:
        """Log many points of one scalar at once (1-D ``values`` and ``steps`` of equal length,
        ``steps`` integers in the int64 range); return how many were kept."""
        _check_name(name)
        values = _checks.real_array(values, "values").astype(np.float64).reshape(-1)
        steps = _check_steps(steps, values.shape)
        self._before_logging(values.size)
        rate = self.sample_rate if sample_rate is None else _check_rate(sample_rate)
        wall_time = time.time()
        with self._lock:
            if rate < 1.0:
                keep = self._rng.random(values.size) < rate
                values, steps = values[keep], steps[keep]
            buffer = self._scalars.setdefault(name, ([], [], []))
            buffer[0].extend(steps.tolist())
            buffer[1].extend([wall_time] * values.size)
            buffer[2].extend(values.tolist())
            self._buffered += values.size
            self._held += values.size
            if self._buffered >= self._wake_at:
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
        finite range, at most ``MAX_BINS``) or as a uniform random subsample of at most
        ``max_samples`` elements (``mode="samples"``, at most ``MAX_SAMPLES``)."""
        _check_name(name)
        step = _checks.int64(step, "step")
        if mode == "histogram":
            bins = _checks.integer(bins, "bins", 1, MAX_BINS)
            kind = _format.HISTOGRAMS
        elif mode == "samples":
            max_samples = _checks.integer(max_samples, "max_samples", 1, MAX_SAMPLES)
            kind = _format.SAMPLES
        else:
            raise ValueError(f"mode must be 'histogram' or 'samples', got {mode!r}")
        flat = _checks.real_array(values, "values").astype(np.float64).reshape(-1)
        entry = _array_entry(flat, kind, bins, max_samples, self._rng) if kind == _format.HISTOGRAMS else None
        self._before_logging()
        wall_time = time.time()
        with self._lock:
            if not self._keep(sample_rate):
                return False
            if entry is None:  # a subsample draws from the generator, under its lock
                entry = _array_entry(flat, kind, bins, max_samples, self._rng)
            self._others.setdefault((kind, name), []).append((step, wall_time, entry))
            self._buffered += 1
            self._held += 1
        return True

    def text(self, name: str, text: str, step: int, *, sample_rate: float | None = None) -> bool:
        """Log a string (at most ``MAX_TEXT_BYTES`` in UTF-8)."""
        _check_name(name)
        _checks.instance(text, "text", str, "a str")
        step = _checks.int64(step, "step")
        data = _checks.utf8(text, "text")
        if len(data) > MAX_TEXT_BYTES:
            raise ValueError(f"text must be at most {MAX_TEXT_BYTES} bytes in UTF-8, got {len(data)}")
        self._before_logging()
        wall_time = time.time()
        with self._lock:
            if not self._keep(sample_rate):
                return False
            self._others.setdefault((_format.TEXTS, name), []).append((step, wall_time, data))
            self._buffered += 1
            self._held += 1
        return True

    # -- failures and backpressure -------------------------------------------------------------
    def _raise_alarm(self) -> None:
        if self._closed:
            raise RuntimeError("SummaryWriter is closed")
        if self._gave_up is not None:
            raise ServiceGaveUpError(self._gave_up)
        with self._lock:
            error, self._error = self._error, None
            self._alarm = self._closed or self._gave_up is not None
        if error is not None:
            raise error

    def _set_error(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = error
            self._alarm = True

    def _wait_for_room(self, entries: int) -> None:
        deadline = None if self.block_seconds is None else time.monotonic() + self.block_seconds
        while self._held > 0 and self._held + entries > self.max_pending:
            if self._alarm:
                self._raise_alarm()
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"summary writer holds {self._held} entries (max_pending={self.max_pending}) and no "
                    f"aggregator acknowledged room for {self.block_seconds} s (block_seconds)")
            if self._thread is None:
                _start_flush_thread(self)
            self._room.clear()
            self._wake.set()
            self._room.wait(0.05)

    # -- flushing ------------------------------------------------------------------------------
    def _freed(self, entries: int) -> None:
        """Acknowledgements freed ``entries`` held entries: room for blocked logging calls."""
        with self._lock:
            self._held -= entries
        self._room.set()

    def _give_up(self, message: str) -> None:
        with self._lock:
            self._gave_up = self._gave_up or message
            self._alarm = True
        self._room.set()

    def _flush_step(self) -> bool:
        """Send the buffers and everything not acknowledged (:meth:`Delivery.send`); returns
        whether everything is acknowledged (then the next flush is due a period after the take)."""
        with self._flush_lock:
            with self._lock:
                scalars, self._scalars = self._scalars, {}
                others, self._others = self._others, {}
                self._buffered = 0
                taken_at = time.monotonic()  # read under the lock: every point logged before it was taken
            return _send(self, take_batches(scalars, others), taken_at)

    def flush(self) -> None:
        """Write everything logged so far; return once every shard's aggregator has acknowledged it
        (waiting through the recreation of a lost aggregator). Raises a background error,
        :class:`SummaryAggregatorError`, or :class:`carlskit.ServiceGaveUpError`."""
        if self._alarm and not self._closed:
            self._raise_alarm()
        while not self._flush_step():
            if self._gave_up is not None:
                raise ServiceGaveUpError(self._gave_up)
            time.sleep(0.02)

    def status(self) -> dict[str, Any]:
        """Health of the writer: per shard its state (``ok``, ``restarting``, ``gave up``), entries
        held for it, restarts, failures in the current streak, restart budget left, last failure
        reason and recovery times (seconds from a failure to the next acknowledged batch); and each
        aggregator's :class:`carlskit.cluster.ServiceStatus` (``services``, for ``ClusterStatus``)."""
        # read without the flush lock (a flush may be waiting on a call): counters, not the queues
        return {"held_entries": self._held, "max_pending": self.max_pending, "placement": str(self.placement),
                "closed": self._closed, "gave_up": self._gave_up, "shards": self._delivery.status(),
                "services": self._delivery.services()}

    def close(self) -> None:
        """Flush, stop the background thread and close the aggregators this writer created (their
        files are closed and synced). Idempotent; raises what :meth:`flush` raises (after closing)."""
        if self._closed:
            return
        self._stop.set()
        self._wake.set()
        if self._thread is not None and threading.current_thread() is not self._thread:
            self._thread.join()
        try:
            self.flush()
        finally:
            self._closed = self._alarm = True
            _open_writers.discard(self)
            self._delivery.close()

    def __enter__(self) -> SummaryWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        where = f"{len(self._shards)} aggregators" if self._delivery.files is None else "direct"
        state = "closed" if self._closed else "open"
        return f"SummaryWriter({str(self.logdir)!r}, {where}, sample_rate={self.sample_rate:g}, {state})"


def _restart_policy(value: RestartPolicy | float | None) -> RestartPolicy:
    return restart_policy(value, "restart_policy")


def _start_flush_thread(writer: SummaryWriter) -> None:
    """Start ``writer``'s background flush in a copy of the caller's context: inside a Dask task
    that context names the worker, which actor calls from the thread need."""
    with writer._lock:
        if writer._thread is not None or writer._closed:
            return
        writer._thread = threading.Thread(target=contextvars.copy_context().run, name="carlskit-summary-flush",
                                          args=(_flush_loop, weakref.ref(writer), writer._wake, writer._stop),
                                          daemon=True)
        writer._thread.start()


def _send(writer: SummaryWriter, batches: list, taken_at: float) -> bool:
    """``writer``'s delivery of the batches taken at ``taken_at``; the next flush is then due a period
    after the take, or (not acknowledged: no bound until a success) a period from now."""
    acknowledged = False
    try:
        acknowledged = writer._delivery.send(batches, writer._writer_id)
    finally:
        due = (taken_at if acknowledged else time.monotonic()) + writer.flush_every_seconds
        writer._flush_due = max(writer._flush_due, due)
    return acknowledged


def _flush_if_overdue(writer: SummaryWriter, began: float) -> None:
    """If ``writer``'s last flush is overdue for a logging call that began at ``began``, flush here,
    so that what was logged a period before ``began`` is in the files when the call returns.
    (``writer._flush_due``: what was logged a period before it is in the files.)

    Measured (issue 43, 2-core machine, 20 scalars a step logged flat out, period 0.1 s): the
    background thread alone shares the GIL with the logging loop and flushed every 0.14-0.23 s on
    average (up to 0.27 s apart), each flush taking up to 0.14 s for up to 160k entries; a SIGKILL
    lost points logged up to 0.29 s before it (the issue's report saw over a second on a more
    loaded machine, where the thread waits longer for the GIL). With this rule the logging call
    flushes whenever the background thread is late, which no scheduling can delay.
    """
    if began <= writer._flush_due:
        return
    # A background flush in progress ends first (its batches are acknowledged when it returns);
    # one stuck longer than OVERDUE_WAIT_SECONDS (a hung aggregator) is left to the background.
    if not writer._flush_lock.acquire(timeout=OVERDUE_WAIT_SECONDS):
        writer._flush_due = time.monotonic() + writer.flush_every_seconds
        return
    try:
        if began <= writer._flush_due:
            return  # that flush took everything logged a period before the call
        if not writer._delivery.all_healthy():
            # a shard is recovering: the background thread serves it every 50 ms; the caller logs on
            writer._flush_due = time.monotonic() + writer.flush_every_seconds
            return
        writer._flush_step()
    except Exception as error:  # raised by the next call, as a background error is (Ctrl-C is not caught)
        writer._set_error(error)
    finally:
        writer._flush_lock.release()


def _flush_loop(writer_ref, wake: threading.Event, stop: threading.Event) -> None:
    while not stop.is_set():
        writer = writer_ref()
        if writer is None:
            return
        # Wake at the flush's due time (a logging call that finds it overdue flushes itself); a shard
        # recovering (or batches awaiting a re-send) is served often, not once a period.
        period = min(max(writer._flush_due - time.monotonic(), 0.0), writer.flush_every_seconds)
        if not writer._delivery.all_healthy():
            period = min(period, 0.05)
        del writer  # hold no strong reference while sleeping, so an abandoned writer is collected
        wake.wait(period)
        wake.clear()
        if stop.is_set():
            return
        writer = writer_ref()
        if writer is None:
            return
        try:
            writer._flush_step()
        except BaseException as error:  # surfaced by the next call (scalar, array, text, flush, close)
            writer._set_error(error)
        del writer


def _rebuild_writer(logdir, aggregators, sample_rate, flush_every_seconds, max_pending,
                    block_seconds=None, policy=None, placement=None):
    placement = placement or Placement()
    adopting = _adopted_aggregators.set(aggregators)
    try:
        return SummaryWriter(logdir, sample_rate=sample_rate, flush_every_seconds=flush_every_seconds,
                             seed=None, max_pending=max_pending, block_seconds=block_seconds,
                             restart_policy=policy, workers=placement.workers, resources=placement.resources)
    finally:
        _adopted_aggregators.reset(adopting)


# The aggregators an unpickled writer adopts (its private constructor path: the public signature carries
# no private parameter; issue 44). None: a new writer starts its own.
_adopted_aggregators: contextvars.ContextVar[list | None] = contextvars.ContextVar("carlskit_adopted_aggregators",
                                                                                  default=None)

