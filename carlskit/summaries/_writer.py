"""``SummaryWriter``: batched, sampled summary logging, direct to files or through sharded aggregators.

Metz et al. 2020 ("Tasks, stability, architecture, and compute"), Appendix H.1: training workers send summaries in
batched calls to aggregator services sharded by summary name, log stochastically (``sample_rate``)
and keep subsampled copies for fast plotting.

Delivery (issue 14): the writer keeps every batch of a shard until that shard's aggregator has
acknowledged it (the acknowledgement is sent after the batch is in the aggregator's file). When an
aggregator's worker dies, the writer recreates that aggregator on a live worker, under the
supervision layer's :class:`~carlskit.cluster._supervised.Backoff`, and re-sends the batches it
holds; the other shards are neither stopped nor re-sent to. A batch that was written but whose
acknowledgement was lost with the worker is therefore written twice; every record carries the
writer's id and the batch's sequence number, and :class:`~carlskit.summaries.SummaryReader` keeps
one copy. The guarantee is at-least-once into the files and exactly-once as read.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import contextvars
import math
import os
import secrets
import threading
import time
import weakref
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from carlskit import _checks
from carlskit._errors import ServiceGaveUpError, WorkerLostError
from carlskit.cluster._loss import actor_lost, is_worker_loss
from carlskit.cluster._placement import NoWorkerError, Placement
from carlskit.cluster._supervised import Backoff, RestartPolicy, restart_policy
from carlskit.summaries import _format
from carlskit.summaries._files import Batch, SummaryFiles, new_origin

#: Upper bounds of size arguments: a typo (``bins=10**9``) is a clear ``ValueError`` here, never a
#: ``MemoryError`` in a background thread. ``max_pending`` entries cost about 100 bytes each.
MAX_PENDING_LIMIT = 100_000_000
MAX_BINS = 65_536
MAX_SAMPLES = 1 << 20
MAX_SHARDS = 1_024
MAX_TEXT_BYTES = (1 << 31) - 1  # lengths are u32 in the file format
#: An aggregator call that has not answered in this long counts as a failed call (retried under
#: the backoff; a batch it did write is dropped as a repeat by readers).
CALL_TIMEOUT_SECONDS = 120.0


def aggregator_of(name: str, n_shards: int) -> int:
    """Stable shard of a summary name: ``crc32(utf8(name)) mod n_shards`` (same in every process,
    unlike Python's salted ``hash``)."""
    return zlib.crc32(name.encode("utf-8")) % n_shards


class SummaryAggregatorError(RuntimeError):
    """An aggregator could not write a batch (its own failure, e.g. a full disk; not a lost worker).

    Raised at the writer's next call; the batch stays with the writer and is re-sent at the next
    flush.
    """


class SummaryAggregator:
    """A Dask actor owning one shard: appends the batches it receives to its own files.

    Created by :class:`SummaryWriter` (one per shard, spread over the workers, recreated on a live
    worker when its worker is lost); not used directly.
    """

    def __init__(self, logdir: str, shard: int):
        self.shard = shard
        self._files = SummaryFiles(logdir, new_origin(f"shard{shard:03d}"))
        self._written: dict[int, int] = {}  # writer id -> highest sequence number written

    def append(self, writer_id: int, sends: list[tuple[int, list[Batch]]]) -> int:
        """Write the ``(sequence, batches)`` not written yet (a re-send after a failed call repeats
        some), in order; return the highest sequence number of ``writer_id`` now in the files: the
        acknowledgement."""
        last = self._written.get(writer_id, -1)
        for sequence, batches in sends:
            if sequence <= last:
                continue
            try:
                self._files.append(batches, writer_id, sequence)
            except Exception as error:  # a type of our own: the writer tells it from a lost worker
                raise SummaryAggregatorError(
                    f"aggregator of shard {self.shard} could not write: {type(error).__name__}: {error}") from None
            last = self._written[writer_id] = sequence
        return last

    def flush_to_disk(self) -> None:
        self._files.flush_to_disk()

    def close(self) -> None:
        self._files.close()

    def status(self) -> dict[str, Any]:
        return {"shard": self.shard, "origin": self._files.origin,
                "records": self._files.records_written, "entries": self._files.entries_written}


class _Shard:
    """What one writer holds for one shard: the aggregator it sends to and the batches that
    aggregator has not acknowledged yet (``(sequence, batches, entries)``, oldest first)."""

    def __init__(self, index: int, policy: RestartPolicy, actor: Any = None, future: Any = None,
                 owned: bool = False):
        self.index, self.actor, self.future, self.owned = index, actor, future, owned
        self.unacked: collections.deque = collections.deque()
        self.next_sequence = 0
        self.held = 0  # entries in unacked
        self.backoff = Backoff(policy)
        self.state = "ok"  # ok | restarting | gave up
        self.needs_new_aggregator = False
        self.creating: Any = None  # the future of an aggregator being created
        self.watched = owned  # a copy's shard gets a future of the actor's key on first use
        self.reason: str | None = None  # why it is restarting now
        self.last_failure: str | None = None  # kept after recovery, for status()
        self.lost_at: float | None = None
        self.restarts = 0
        self.recoveries: list[float] = []  # seconds from a failure to the next acknowledged batch
        self.old_futures: list[Any] = []  # futures of replaced aggregators, released at close



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

    Lost aggregators: the writer holds each shard's batches until its aggregator acknowledges
    them. An aggregator whose worker is lost (detected by type: :func:`carlskit.cluster.is_worker_loss`,
    :func:`carlskit.cluster.actor_lost`) is recreated on a live worker with exponential backoff
    (``restart_policy``) and the held batches are re-sent, so no point is lost; the other shards
    keep flushing meanwhile. A batch can reach the files twice (written, then the worker died
    before acknowledging); readers drop the repeat (at-least-once on disk, exactly-once as read).
    When a shard's restart budget is spent, the writer's next call raises
    :class:`carlskit.ServiceGaveUpError`. An aggregator's own failure (e.g. a full disk) raises
    :class:`SummaryAggregatorError` at the next call and the batch is re-sent at the next flush.
    :meth:`status` shows each shard's state, held entries, restarts and recovery times.

    Backpressure: at most ``max_pending`` entries are held (buffered plus sent but not
    acknowledged). A logging call that finds the bound reached blocks until acknowledgements make
    room, at most ``block_seconds`` (then ``TimeoutError``; ``None`` waits until room is made or the
    restart budget is spent).

    Stochastic logging (H.1): each call is kept with probability ``sample_rate`` (the writer's, or
    the call's own), drawn from a generator seeded by ``seed``.

    The writer pickles: a copy sent to a Dask task logs through the same aggregators (or, without a
    client, to its own files); closing that copy flushes it and leaves the aggregators running. A
    copy that finds an aggregator lost creates its own replacement (closed with the copy). A copy
    samples from fresh entropy, not from ``seed``. Points still buffered in a writer that is
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
        _aggregators: list | None = None,
    ):
        _checks.path(logdir, "logdir")
        self.sample_rate = _check_rate(sample_rate)
        self.flush_every_seconds = _checks.positive_float(flush_every_seconds, "flush_every_seconds")
        self.max_pending = _checks.integer(max_pending, "max_pending", 1, MAX_PENDING_LIMIT)
        self.block_seconds = None if block_seconds is None else _checks.finite_float(
            block_seconds, "block_seconds", minimum=0.0)
        self.restart_policy = _restart_policy(restart_policy)
        self.placement = Placement.of(workers, resources)
        if client is None and _aggregators is None and self.placement.restricted:
            raise ValueError("workers/resources place aggregators on a Dask cluster: pass a client too")
        if n_shards is not None:
            n_shards = _checks.integer(n_shards, "n_shards", 1, MAX_SHARDS)
        if seed is not None:  # a bool is not a seed (numpy would take True as 1)
            seed = _checks.integer(seed, "seed", 0)
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._wake_at = max(1, self.max_pending // 4)
        self._seed = seed
        self._rng = np.random.default_rng(seed)
        self._writer_id = secrets.randbits(64)  # marks this object's batches (copies get their own)
        self._lock = threading.Lock()  # guards the buffers, the counters and the generator
        self._flush_lock = threading.Lock()  # one flush step at a time keeps batches in order
        self._room = threading.Event()  # set when acknowledgements free held entries
        self._scalars: dict[str, tuple[list, list, list]] = {}
        self._others: dict[tuple[int, str], list] = {}
        self._buffered = 0  # entries in the buffers
        self._held = 0  # entries buffered or awaiting acknowledgement (the backpressure bound)
        self._error: BaseException | None = None
        self._gave_up: str | None = None
        self._closed = False
        self._alarm = False  # closed, a background error or a give-up: checked by every call
        self._client = client
        self._files: SummaryFiles | None = None
        self._shards, self._owns_aggregators = self._open_shards(client, n_shards, _aggregators)
        if self._shards[0].actor is None:
            self._files = SummaryFiles(self.logdir, new_origin("writer"))
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None  # started by the first logging call
        _open_writers.add(self)

    # -- aggregators ---------------------------------------------------------------------------
    def _open_shards(self, client: Any, n_shards: int | None, aggregators: list | None) -> tuple[list[_Shard], bool]:
        """The shards this writer sends to, and whether it started (and so owns) their aggregators:
        those of a copy unpickled in another process, new ones on ``client``'s workers, or one
        local shard writing files from this process."""
        if aggregators is not None:  # a copy unpickled in another process
            return [_Shard(index, self.restart_policy, actor) for index, actor in enumerate(aggregators)], False
        if client is not None:
            return self._start_aggregators(client, n_shards), True
        return [_Shard(0, self.restart_policy)], False

    def _start_aggregators(self, client, n_shards: int | None) -> list[_Shard]:
        workers = self.placement.candidates(client)
        if not workers:
            raise ValueError(f"no worker matches the aggregators' placement ({self.placement})")
        if n_shards is None:
            n_shards = min(max(1, len(workers)), MAX_SHARDS)
        logdir = str(self.logdir.resolve())
        futures = [
            client.submit(
                SummaryAggregator, logdir, shard, actor=True, pure=False,
                workers=[workers[shard % len(workers)]], allow_other_workers=False,
            )
            for shard in range(n_shards)
        ]
        return [_Shard(shard, self.restart_policy, future.result(), future, owned=True)
                for shard, future in enumerate(futures)]

    @property
    def n_shards(self) -> int:
        return len(self._shards)

    @property
    def _aggregators(self) -> list:
        return [shard.actor for shard in self._shards if shard.actor is not None]

    def __reduce__(self):
        aggregators = self._aggregators or None
        return (_rebuild_writer, (str(self.logdir), aggregators, self.sample_rate,
                                  self.flush_every_seconds, self.max_pending, self.block_seconds,
                                  self.restart_policy, self.placement))

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

    def _before_logging(self, entries: int = 1) -> None:
        """Raise what the background found (closed, error, give-up); wait for room if the bound
        is reached; start the flush thread."""
        if self._alarm:
            self._raise_alarm()
        if self._held + entries > self.max_pending and self._held > 0:
            self._wait_for_room(entries)
        if self._thread is None:
            self._start_flush_thread()

    def scalar(self, name: str, value: float, step: int, *, sample_rate: float | None = None) -> bool:
        """Log one scalar; return whether it was kept by sampling. Costs about a microsecond.

        ``step`` must be an integer (Python or numpy, not bool) in the int64 range, checked here:
        a bad call raises and leaves every pending point as it was."""
        # The common case (open, room, a float and an int) costs attribute checks, no calls.
        if self._alarm or self._held >= self.max_pending or self._thread is None:
            self._before_logging()
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
        try:
            steps = np.asarray(steps)
        except (ValueError, TypeError) as error:
            raise ValueError(f"steps must be integers of shape {values.shape} like values, got a ragged or "
                             f"unconvertible {type(steps).__name__}") from error
        if steps.shape != values.shape or steps.dtype.kind not in "iu":
            raise ValueError(
                f"steps must be integers of shape {values.shape} like values, got {steps.dtype} {steps.shape}"
            )
        if steps.dtype.kind == "u" and steps.size and int(steps.max()) > _checks.INT64_MAX:
            raise ValueError(f"steps must fit in int64, got a step of {int(steps.max())}")
        steps = steps.astype(np.int64)
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
        if kind == _format.HISTOGRAMS:
            finite = flat[np.isfinite(flat)]
            counts, edges = np.histogram(finite, bins=bins) if finite.size else (
                np.zeros(bins), np.linspace(0.0, 1.0, bins + 1))
            entry = (bins, edges.astype(np.float64), counts.astype(np.float64))
        self._before_logging()
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
                self._start_flush_thread()
            self._room.clear()
            self._wake.set()
            self._room.wait(0.05)

    # -- flushing ------------------------------------------------------------------------------
    def _take_batches(self) -> list[Batch]:
        with self._lock:
            scalars, self._scalars = self._scalars, {}
            others, self._others = self._others, {}
            self._buffered = 0
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

    def _acknowledged(self, shard: _Shard, sequence: int) -> None:
        freed = 0
        while shard.unacked and shard.unacked[0][0] <= sequence:
            freed += shard.unacked.popleft()[2]
        shard.held -= freed
        with self._lock:
            self._held -= freed
        if shard.backoff.failures or shard.state != "ok":
            if shard.lost_at is not None:
                shard.recoveries.append(time.monotonic() - shard.lost_at)
            shard.backoff.success()
            shard.state, shard.reason, shard.lost_at = "ok", None, None
        self._room.set()

    def _flush_step(self) -> bool:
        """Move the buffers into per-shard batches and send every shard what it has not
        acknowledged; recreate lost aggregators whose backoff has passed. Returns whether
        everything is acknowledged. Raises an aggregator's own error (after every shard was
        served)."""
        with self._flush_lock:
            batches = self._take_batches()
            per_shard: dict[int, list[Batch]] = {}
            for batch in batches:
                per_shard.setdefault(aggregator_of(batch[1], len(self._shards)), []).append(batch)
            for index, part in per_shard.items():
                shard = self._shards[index]
                entries = sum(batch[2] for batch in part)
                shard.unacked.append((shard.next_sequence, part, entries))
                shard.next_sequence += 1
                shard.held += entries
            if self._files is not None:
                return self._write_direct()
            calls, errors = [], []
            for shard in self._shards:
                if shard.state == "restarting":
                    self._try_restart(shard)
                if shard.state != "ok" or not shard.unacked:
                    continue
                self._watch(shard)
                sends = [(sequence, part) for sequence, part, _ in shard.unacked]
                try:
                    calls.append((shard, shard.actor.append(self._writer_id, sends)))
                except Exception as error:
                    self._failed(shard, error, errors)
            for shard, call in calls:
                try:
                    self._acknowledged(shard, self._result_of(shard, call))
                except Exception as error:
                    self._failed(shard, error, errors)
            if errors:
                raise errors[0]
            return not any(shard.unacked for shard in self._shards)

    def _result_of(self, shard: _Shard, call: Any) -> int:
        """The acknowledgement of an aggregator call. Waits in short slices, so a call to a worker
        that died is given up as soon as the actor's future says so (a connection attempt to a
        dead worker's address is otherwise retried for distributed's 30 s connect timeout)."""
        deadline = time.monotonic() + CALL_TIMEOUT_SECONDS
        while True:
            done = call.done()
            try:
                return call.result(timeout=None if done else 0.05)
            except TimeoutError:
                if done:
                    raise
            if actor_lost(shard.future):
                raise WorkerLostError(f"the worker holding the aggregator of shard {shard.index} was lost")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the aggregator of shard {shard.index} did not answer in "
                                   f"{CALL_TIMEOUT_SECONDS:g} s")

    def _watch(self, shard: _Shard) -> None:
        """Give a copy's shard a future of the actor's key (a copy is handed actors, not the
        futures that made them), so its loss is known from the future's state."""
        if shard.future is not None or shard.watched:
            return
        shard.watched = True
        try:
            from distributed import Future

            # Not waited on: inside a task that wait cost up to 30 s a shard. Until the scheduler
            # confirms it the future is "pending", which actor_lost does not count as a loss.
            shard.future = Future(shard.actor.key, self._restart_client())
        except Exception:  # no client here: the loss is then told by the worker list (_actor_gone)
            shard.future = None

    def _write_direct(self) -> bool:
        shard = self._shards[0]
        while shard.unacked:
            sequence, part, _ = shard.unacked[0]
            self._files.append(part, self._writer_id, sequence)  # an error keeps the batch for later
            self._acknowledged(shard, sequence)
        return True

    def _failed(self, shard: _Shard, error: BaseException, errors: list) -> None:
        """One shard's call failed: an aggregator's own error is reported (the batch is re-sent
        next flush); anything else is a lost or unreachable aggregator, retried with backoff."""
        if isinstance(error, SummaryAggregatorError):
            errors.append(error)
            return
        if shard.lost_at is None:
            shard.lost_at = time.monotonic()
        shard.reason = shard.last_failure = f"{type(error).__name__}: {error}"
        # Lost for good (recreate it) or maybe only unreachable for now (call it again): by type
        # and by the state of the future that created the actor, never by message text.
        shard.needs_new_aggregator = shard.needs_new_aggregator or is_worker_loss(error) or self._actor_gone(shard)
        delay = shard.backoff.failure()
        if delay is None:
            shard.state = "gave up"
            message = (f"SummaryWriter({str(self.logdir)!r}): gave up the aggregator of shard {shard.index} after "
                       f"{shard.backoff.failures} failures in {self.restart_policy.budget_seconds:g} s "
                       f"(restart budget spent); {shard.held} entries are still held; last: {shard.reason}")
            with self._lock:
                self._gave_up = self._gave_up or message
                self._alarm = True
            self._room.set()
            return
        shard.state = "restarting"

    def _actor_gone(self, shard: _Shard) -> bool:
        if shard.future is not None:
            return actor_lost(shard.future)
        # A copy in a task holds no future: the actor is gone when its worker left the cluster.
        try:
            workers = self._restart_client().scheduler_info(n_workers=-1)["workers"]
        except Exception:
            return False
        return getattr(shard.actor, "_address", None) not in workers

    def _restart_client(self):
        if self._client is not None:
            return self._client
        from distributed import get_client

        return get_client()

    def _try_restart(self, shard: _Shard) -> None:
        """Advance a restarting shard: wait out its backoff, then call its aggregator again or
        create a new one on a live worker; a new aggregator counts once it is built."""
        if shard.creating is not None:
            if shard.creating.status == "pending":
                if shard.backoff.seconds_left() <= 0.0:  # e.g. no worker at all: the budget ends the wait
                    future, shard.creating = shard.creating, None
                    with contextlib.suppress(Exception):
                        future.release()
                    self._failed(shard, TimeoutError("the new aggregator was not built within the restart "
                                                     "budget (no live worker took it)"), [])
                return
            future, shard.creating = shard.creating, None
            try:
                actor = future.result(timeout=CALL_TIMEOUT_SECONDS)
            except Exception as error:
                self._failed(shard, error, [])
                return
            if shard.future is not None:
                shard.old_futures.append(shard.future)  # released at close
            shard.actor, shard.future, shard.owned = actor, future, True
            shard.needs_new_aggregator = False
            shard.restarts += 1
            shard.state = "ok"  # acknowledged batches end the failure streak (_acknowledged)
            return
        if not shard.backoff.ready():
            return
        if not shard.needs_new_aggregator:
            if self._actor_gone(shard):
                shard.needs_new_aggregator = True
            else:
                shard.state = "ok"  # call the same aggregator again
                return
        try:
            client = self._restart_client()
            lost = getattr(shard.actor, "_address", None)
            workers = sorted(set(self.placement.candidates(client)) - {lost})
            if not workers:
                raise NoWorkerError(f"no live worker to recreate the aggregator on (placement: {self.placement})")
            load = collections.Counter(getattr(other.actor, "_address", None) for other in self._shards)
            worker = min(workers, key=lambda address: (load[address], address))
            shard.creating = client.submit(
                SummaryAggregator, str(self.logdir.resolve()), shard.index, actor=True, pure=False,
                workers=[worker], allow_other_workers=False)
        except Exception as error:
            self._failed(shard, error, [])

    def _background_flush(self) -> None:
        try:
            self._flush_step()
        except BaseException as error:  # surfaced by the next call (scalar, array, text, flush, close)
            self._set_error(error)

    def _all_healthy(self) -> bool:
        """No shard recovering or holding batches to re-send (a given-up shard waits no more)."""
        return not any(shard.state == "restarting" or (shard.state == "ok" and shard.unacked)
                       for shard in self._shards)

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
        reason and recovery times (seconds from a failure to the next acknowledged batch)."""
        # read without the flush lock (a flush may be waiting on a call): counters, not the queues
        shards = [{"shard": shard.index, "state": shard.state, "held_entries": shard.held,
                   "unacknowledged_batches": len(shard.unacked), "restarts": shard.restarts,
                   "failures": shard.backoff.failures,
                   "budget_left_seconds": round(shard.backoff.seconds_left(), 3),
                   "reason": shard.reason, "last_failure": shard.last_failure,
                   "recovery_seconds": list(shard.recoveries),
                   "worker": getattr(shard.actor, "_address", None)}
                  for shard in self._shards]
        return {"held_entries": self._held, "max_pending": self.max_pending, "placement": str(self.placement),
                "closed": self._closed, "gave_up": self._gave_up, "shards": shards}

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
            if self._files is not None:
                self._files.close()
            self._close_aggregators()

    def _close_aggregators(self) -> None:
        calls = []
        for shard in self._shards:
            if shard.owned and shard.actor is not None and not self._actor_gone(shard):
                with contextlib.suppress(Exception):  # a lost one has nothing left to close
                    calls.append(shard.actor.close())
        for call in calls:
            with contextlib.suppress(Exception):
                call.result(timeout=CALL_TIMEOUT_SECONDS)
        for shard in self._shards:
            # a copy's watch future is released too; only the aggregators it built are closed
            futures = ([shard.future] if shard.future is not None else []) + shard.old_futures
            if shard.creating is not None:
                futures.append(shard.creating)
            for future in futures:
                with contextlib.suppress(Exception):
                    future.release()
            shard.old_futures, shard.creating, shard.future = [], None, None

    def __enter__(self) -> SummaryWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        where = f"{len(self._shards)} aggregators" if self._files is None else "direct"
        state = "closed" if self._closed else "open"
        return f"SummaryWriter({str(self.logdir)!r}, {where}, sample_rate={self.sample_rate:g}, {state})"


def _restart_policy(value: RestartPolicy | float | None) -> RestartPolicy:
    return restart_policy(value, "restart_policy")


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
        # a shard recovering (or batches awaiting a re-send) is served often, not once a period
        period = writer.flush_every_seconds if writer._all_healthy() else min(writer.flush_every_seconds, 0.05)
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


def _rebuild_writer(logdir, aggregators, sample_rate, flush_every_seconds, max_pending,
                    block_seconds=None, policy=None, placement=None):
    placement = placement or Placement()
    return SummaryWriter(logdir, sample_rate=sample_rate, flush_every_seconds=flush_every_seconds,
                         seed=None, max_pending=max_pending, block_seconds=block_seconds,
                         restart_policy=policy, workers=placement.workers, resources=placement.resources,
                         _aggregators=aggregators)

