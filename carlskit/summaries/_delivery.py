"""How a :class:`~carlskit.summaries.SummaryWriter`'s batches reach the files: sharded aggregators
kept alive by the service kit of :mod:`carlskit.cluster`, or the writer's own files.

Each shard holds its batches until its aggregator acknowledged them (issue 14). A shard's
aggregator is an :class:`carlskit.cluster.ActorHost` (placed, rebuilt on the least-loaded live
worker through :meth:`carlskit.cluster.Placement.choose`, its old future released) under a
:class:`carlskit.cluster.ServiceState` (backoff, the one give-up message, its status row). A lost
or unreachable aggregator (by type, :func:`carlskit.cluster.is_worker_loss`, or by its actor's
state) is called again or rebuilt after its backoff delay and the held batches are re-sent; the
other shards go on. An aggregator's own error (:class:`SummaryAggregatorError`) is raised to the
writer and the batch re-sent at the next flush.
"""

from __future__ import annotations

import collections
import time
import zlib
from pathlib import Path
from typing import Any, Callable

import numpy as np

from carlskit._errors import WorkerLostError
from carlskit.cluster import (
    ActorHost,
    Placement,
    RestartPolicy,
    ServiceState,
    ServiceStatus,
    actor_lost,
    is_worker_loss,
)
from carlskit.summaries import _format
from carlskit.summaries._files import Batch, SummaryFiles, new_origin

MAX_SHARDS = 1_024
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


class Shard:
    """What one writer holds for one shard: its aggregator (an :class:`ActorHost`, or none when the
    writer writes its own files), the batches not acknowledged yet (``(sequence, batches,
    entries)``, oldest first) and its :class:`ServiceState`."""

    def __init__(self, index: int, service: ServiceState, host: ActorHost, actor: Any = None, future: Any = None,
                 owned: bool = False):
        self.index, self.service, self.host, self.owned = index, service, host, owned
        host.actor, host.future = actor, future
        host.worker = getattr(actor, "_address", None)
        self.unacked: collections.deque = collections.deque()
        self.next_sequence = 0
        self.held = 0  # entries in unacked
        self.needs_new_aggregator = False
        self.watched = owned  # a copy's shard gets a future of the actor's key on first use
        self.last_failure: str | None = None  # kept after recovery, for status()
        self.lost_at: float | None = None
        self.recoveries: list[float] = []  # seconds from a failure to the next acknowledged batch

    @property
    def actor(self) -> Any:
        return self.host.actor

    @property
    def state(self) -> str:
        """``ok``, ``restarting`` or ``gave up`` (the writer's names of running, restarting, gave up)."""
        return "ok" if self.service.state in ("running", "stopped") else self.service.state


class Delivery:
    """The shards of one writer and the sending of their batches (see the module docstring).

    Args:
      logdir: the summary directory.
      policy: the restart policy of every shard's aggregator.
      placement: where aggregators may run.
      client: a ``distributed.Client`` (new aggregators), or ``None``.
      n_shards: aggregators to start (default: one per worker).
      aggregators: the actors of a writer unpickled in another process (not owned).
      on_freed: called with the number of entries an acknowledgement freed.
      on_gave_up: called with the give-up message of a shard.
    """

    def __init__(self, logdir: Path, policy: RestartPolicy, placement: Placement, client: Any,
                 n_shards: int | None, aggregators: list | None, on_freed: Callable[[int], None],
                 on_gave_up: Callable[[str], None]) -> None:
        self.logdir, self.policy, self.placement, self.client = logdir, policy, placement, client
        self.on_freed, self.on_gave_up = on_freed, on_gave_up
        self.files: SummaryFiles | None = None
        self.owned = aggregators is None and client is not None
        if aggregators is not None:  # a copy unpickled in another process
            self.shards = [self._shard(index, actor) for index, actor in enumerate(aggregators)]
        elif client is not None:
            self.shards = self._start_aggregators(n_shards)
        else:
            self.shards = [self._shard(0)]
            self.files = SummaryFiles(self.logdir, new_origin("writer"))

    def _shard(self, index: int, actor: Any = None, future: Any = None, owned: bool = False) -> Shard:
        service = ServiceState(f"SummaryWriter({str(self.logdir)!r})", f"the aggregator of shard {index}",
                               self.policy, placement=self.placement)
        service.start()
        return Shard(index, service, ActorHost(self.client, self.placement, f"summary-aggregator-{index}"),
                     actor, future, owned)

    def _start_aggregators(self, n_shards: int | None) -> list[Shard]:
        workers = self.placement.candidates(self.client)
        if not workers:
            raise ValueError(f"no worker matches the aggregators' placement ({self.placement})")
        n_shards = min(max(1, len(workers)), MAX_SHARDS) if n_shards is None else n_shards
        futures = [self.client.submit(SummaryAggregator, str(self.logdir.resolve()), shard, actor=True, pure=False,
                                      workers=[workers[shard % len(workers)]], allow_other_workers=False)
                   for shard in range(n_shards)]
        return [self._shard(shard, future.result(), future, owned=True) for shard, future in enumerate(futures)]

    @property
    def aggregators(self) -> list:
        return [shard.actor for shard in self.shards if shard.actor is not None]

    # -- sending ---------------------------------------------------------------------------------
    def send(self, batches: list[Batch], writer_id: int) -> bool:
        """Queue ``batches`` on their shards and send every shard what it has not acknowledged;
        rebuild lost aggregators whose backoff has passed. Returns whether everything is
        acknowledged. Raises an aggregator's own error (after every shard was served)."""
        per_shard: dict[int, list[Batch]] = {}
        for batch in batches:
            per_shard.setdefault(aggregator_of(batch[1], len(self.shards)), []).append(batch)
        for index, part in per_shard.items():
            shard = self.shards[index]
            entries = sum(batch[2] for batch in part)
            shard.unacked.append((shard.next_sequence, part, entries))
            shard.next_sequence += 1
            shard.held += entries
        if self.files is not None:
            shard = self.shards[0]
            while shard.unacked:
                sequence, part, _ = shard.unacked[0]
                self.files.append(part, writer_id, sequence)  # an error keeps the batch for later
                self._acknowledged(shard, sequence)
            return True
        calls, errors = [], []
        for shard in self.shards:
            if shard.service.state == "restarting":
                self._try_restart(shard)
            if shard.service.state != "running" or not shard.unacked:
                continue
            self._watch(shard)
            try:
                calls.append((shard, shard.actor.append(writer_id, [(s, part) for s, part, _ in shard.unacked])))
            except Exception as error:
                self._failed(shard, error, errors)
        for shard, call in calls:
            try:
                self._acknowledged(shard, self._result_of(shard, call))
            except Exception as error:
                self._failed(shard, error, errors)
        if errors:
            raise errors[0]
        return not any(shard.unacked for shard in self.shards)

    def _acknowledged(self, shard: Shard, sequence: int) -> None:
        freed = 0
        while shard.unacked and shard.unacked[0][0] <= sequence:
            freed += shard.unacked.popleft()[2]
        shard.held -= freed
        self.on_freed(freed)
        if shard.service.backoff.failures or shard.service.state != "running":
            if shard.lost_at is not None:
                shard.recoveries.append(time.monotonic() - shard.lost_at)
            shard.service.recovered()
            shard.lost_at = None

    def _result_of(self, shard: Shard, call: Any) -> int:
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
            if actor_lost(shard.host.future):
                raise WorkerLostError(f"the worker holding the aggregator of shard {shard.index} was lost")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the aggregator of shard {shard.index} did not answer in "
                                   f"{CALL_TIMEOUT_SECONDS:g} s")

    def _client(self) -> Any:
        """The client of rebuilds and watches: the writer's, or the worker's inside a task."""
        if self.client is None:
            from distributed import get_client

            self.client = get_client()
            for shard in self.shards:
                shard.host.client = self.client
        return self.client

    def _watch(self, shard: Shard) -> None:
        """Give a copy's shard a future of the actor's key (a copy is handed actors, not the
        futures that made them), so its loss is known from the future's state."""
        if shard.host.future is not None or shard.watched:
            return
        shard.watched = True
        try:
            from distributed import Future

            # Not waited on: inside a task that wait cost up to 30 s a shard. Until the scheduler
            # confirms it the future is "pending", which actor_lost does not count as a loss.
            shard.host.future = Future(shard.actor.key, self._client())
        except Exception:  # no client here: the loss is then told by the worker list (_gone)
            shard.host.future = None

    def _gone(self, shard: Shard) -> bool:
        """Whether the shard's actor is lost: its future's state, or (a copy without one) its worker
        missing from the scheduler."""
        if shard.host.future is not None:
            return actor_lost(shard.host.future)
        try:
            self._client()
        except Exception:  # noqa: BLE001 - no client: nothing known
            return False
        return shard.host.lost()

    def _failed(self, shard: Shard, error: BaseException, errors: list) -> None:
        """One shard's call failed: an aggregator's own error is reported (the batch is re-sent
        next flush); anything else is a lost or unreachable aggregator, retried with backoff."""
        if isinstance(error, SummaryAggregatorError):
            errors.append(error)
            return
        if shard.lost_at is None:
            shard.lost_at = time.monotonic()
        shard.last_failure = f"{type(error).__name__}: {error}"
        # Lost for good (rebuild it) or maybe only unreachable for now (call it again): by type
        # and by the state of the future that created the actor, never by message text.
        shard.needs_new_aggregator = shard.needs_new_aggregator or is_worker_loss(error) or self._gone(shard)
        if shard.service.failed(shard.last_failure, f"{shard.held} entries are still held") is None:
            self.on_gave_up(shard.service.gave_up)

    def _try_restart(self, shard: Shard) -> None:
        """Advance a restarting shard: wait out its backoff, then call its aggregator again or
        build a new one on the least-loaded live worker; a new aggregator counts once it is built."""
        host = shard.host
        if host.creating is not None:
            if host.creating.status == "pending":
                if shard.service.backoff.seconds_left() <= 0.0:  # e.g. no worker at all: the budget ends the wait
                    future, host.creating = host.creating, None
                    future.release()
                    self._failed(shard, TimeoutError("the new aggregator was not built within the restart "
                                                     "budget (no live worker took it)"), [])
                return
            try:
                host.adopt(CALL_TIMEOUT_SECONDS)  # releases the lost aggregator's future
            except Exception as error:
                self._failed(shard, error, [])
                return
            shard.owned, shard.needs_new_aggregator = True, False
            shard.service.restarts += 1
            shard.service.state = "running"  # acknowledged batches end the failure streak (_acknowledged)
            return
        if not shard.service.ready():
            return
        if not shard.needs_new_aggregator:
            if not self._gone(shard):
                shard.service.state = "running"  # call the same aggregator again
                return
            shard.needs_new_aggregator = True
        try:
            self._client()
            load = collections.Counter(other.host.worker for other in self.shards)
            host.submit(SummaryAggregator, str(self.logdir.resolve()), shard.index,
                        exclude=[host.worker] if host.worker else [], load=load)
        except Exception as error:
            self._failed(shard, error, [])

    # -- reports and closing ---------------------------------------------------------------------
    def all_healthy(self) -> bool:
        """No shard recovering or holding batches to re-send (a given-up shard waits no more)."""
        return not any(shard.state == "restarting" or (shard.state == "ok" and shard.unacked)
                       for shard in self.shards)

    def status(self) -> list[dict[str, Any]]:
        """Per shard: state, held entries, restarts, failures, budget left, reasons, recoveries."""
        return [{"shard": shard.index, "state": shard.state, "held_entries": shard.held,
                 "unacknowledged_batches": len(shard.unacked), "restarts": shard.service.restarts,
                 "failures": shard.service.backoff.failures,
                 "budget_left_seconds": round(shard.service.backoff.seconds_left(), 3),
                 "reason": shard.service.reason, "last_failure": shard.last_failure,
                 "recovery_seconds": list(shard.recoveries), "worker": getattr(shard.actor, "_address", None)}
                for shard in self.shards]

    def services(self) -> dict[str, ServiceStatus]:
        """Each aggregator's :class:`carlskit.cluster.ServiceStatus` (none when writing files here)."""
        if self.files is not None:
            return {}
        return {f"aggregator {shard.index}": shard.service.status(getattr(shard.actor, "_address", None),
                                                                  held_entries=shard.held)
                for shard in self.shards}

    def close(self) -> None:
        """Close the writer's files, or the aggregators this writer built; release every future."""
        if self.files is not None:
            self.files.close()
        calls = []
        for shard in self.shards:
            if shard.owned and shard.actor is not None and not self._gone(shard):
                try:
                    calls.append(shard.actor.close())
                except Exception:  # noqa: BLE001 - a lost one has nothing left to close
                    pass
        for call in calls:
            try:
                call.result(timeout=CALL_TIMEOUT_SECONDS)
            except Exception:  # noqa: BLE001 - lost meanwhile: its files were synced at each append
                pass
        for shard in self.shards:
            # a copy's watch future is released too; only the aggregators it built are closed
            actor = shard.host.actor
            shard.host.release()
            shard.host.actor = actor  # the handle stays readable (status, repr); its future is gone


def take_batches(scalars: dict[str, tuple[list, list, list]], others: dict[tuple[int, str], list]) -> list[Batch]:
    """The writer's buffers as batches: one per scalar name, one per (kind, name) of the others."""
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
