"""One shard of a knowledge bank: a plain in-process object, or a Dask actor on a worker.

Every method handles a whole batch for one table and is guarded by a lock, so the same object is
safe as a threaded in-process shard and as an actor (Dask runs one actor method at a time anyway).
Input is validated by the client before any shard is called; the shard trusts it.
"""

from __future__ import annotations

import collections
import ctypes
import threading
import time
from typing import Any, Callable

import numpy as np

from carlskit.bank._config import EmbeddingTableConfig, TableConfig
from carlskit.bank._snapshot import Location, PartReader, part_file_name, write_part
from carlskit.bank._tables import EmbeddingTable, FeatureTable, RowStore
from carlskit.bank._wal import WriteAheadLog, records_since

#: glibc ``mallopt`` parameters and the values a shard's worker process gets (see below).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_BYTES = 32 << 20
_TRIM_THRESHOLD_BYTES = 64 << 20
#: Gradient push ids remembered per table and shard (live, in snapshots, rebuilt by a log replay).
#: A re-send follows its ShardLostError within a few calls, so far fewer would do.
PUSHES_KEPT = 1024


def reuse_freed_batch_memory() -> bool:
    """Let this process reuse freed memory for per-batch arrays instead of faulting in new pages.

    Dask nannies start workers with ``MALLOC_TRIM_THRESHOLD_=65536``; setting it switches off
    glibc's adaptive mmap threshold, so every array over 128 KiB (a 2048 x 64 float32 lookup result
    is 512 KiB) is a fresh ``mmap``, page-faulted and zeroed by the kernel, then unmapped again:
    measured 0.35 ms of a 0.8 ms lookup (2048 keys, 500k-row shard). This sets the values glibc's
    adaptive rule reaches in a plain process (mmap above 32 MiB, trim above 64 MiB of free heap
    top); the lookup then takes 0.2 ms. Returns False where there is no glibc (nothing changed).
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library already loaded into this process
    except (OSError, AttributeError, TypeError):  # no glibc (macOS, Windows): nothing to tune
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES))


class _Shard:
    def __init__(self, shard_index: int, num_shards: int,
                 clock: Callable[[], float] | None = None, *, worker_process: bool = False) -> None:
        """``worker_process``: the shard is a Dask actor in a worker process of its own, whose
        allocator is tuned for batch arrays (:func:`reuse_freed_batch_memory`)."""
        if worker_process:
            reuse_freed_batch_memory()
        self.shard_index = shard_index
        self.num_shards = num_shards
        self._clock = clock or time.time
        self._tables: dict[str, RowStore] = {}
        self._lock = threading.Lock()
        self._direct_server: Any = None
        self._wal: WriteAheadLog | None = None
        # per table, the ids of the last PUSHES_KEPT gradient pushes applied (oldest first): a push
        # re-sent after a ShardLostError whose id is here was applied already (see apply_gradients)
        self._pushes: dict[str, collections.OrderedDict[int, None]] = {}

    def _table(self, name: str) -> tuple[RowStore, float]:
        """A table for a call that only reads it: the ttl flush it may trigger is logged."""
        table = self._tables[name]
        now = self._clock()
        if table.maintain(now) and self._wal is not None:
            self._wal.append("maintain", now, (name,))
        return table, now

    def _write(self, method: str, name: str | None, *args: Any) -> Any:
        """A call that changes the shard: logged first (write-ahead), then applied."""
        now = self._clock()
        if self._wal is not None:
            self._wal.append(method, now, (name, *args))
        return self._apply(method, now, name, *args)

    def _acknowledged(self, method: str, name: str | None, *args: Any, wait: bool = True) -> Any:
        """:meth:`_write` under the shard's lock; then, outside it, wait until the log's durability
        holds the record (``"machine"``: a group fsync; see :mod:`carlskit.bank._wal`)."""
        with self._lock:
            result = self._write(method, name, *args)
            wal = self._wal
            ticket = wal.appended if wal is not None else 0
        if wait and wal is not None:
            wal.wait_durable(ticket)
        return result

    def _apply(self, method: str, now: float, name: str | None, *args: Any) -> Any:
        """Apply one logged call at its time ``now`` (live calls and write-ahead log replay)."""
        if method == "flush":
            for table_name in [name] if name is not None else list(self._tables):
                self._tables[table_name].flush_all(now)
            return None
        table = self._tables[name]
        table.maintain(now)
        if method == "maintain":
            return None
        if method == "apply_gradients":
            keys, gradients, *push = args  # records logged before push ids existed have none
            if push and push[0] is not None and self._seen_push(name, push[0]):
                table.counters["repeated_pushes_skipped"] += 1
                return None
            return table.apply_gradients(keys, gradients, now)
        return getattr(table, method)(*args, now)

    def _seen_push(self, name: str, push_id: int) -> bool:
        """True if table ``name`` applied push ``push_id`` already; else remember it (the last
        PUSHES_KEPT per table)."""
        seen = self._pushes.setdefault(name, collections.OrderedDict())
        if push_id in seen:
            return True
        seen[push_id] = None
        if len(seen) > PUSHES_KEPT:
            seen.popitem(last=False)
        return False

    def ping(self) -> int:
        return self.shard_index

    def open_direct_path(self, host: str | None = None) -> dict[str, str] | None:
        """Start serving the batch methods on a ZeroMQ socket beside the actor (see
        :mod:`carlskit.bank._direct`); its address, or None where the worker does not speak plain
        tcp or ``host`` (default: the worker's contact host) cannot be bound (the bank then keeps
        to Dask's RPC)."""
        import zmq

        from carlskit.bank._direct import DirectServer, worker_host

        with self._lock:
            if self._direct_server is None:
                host = host or worker_host()
                if host is None:
                    return None
                try:
                    self._direct_server = DirectServer(self, host)
                except zmq.ZMQError:  # e.g. a contact address that is not a local interface
                    return None
            return self._direct_server.address

    def direct_path_serving(self, token: str) -> bool:
        """Whether this shard's direct server with ``token`` is running (no lock: answers while
        the server holds it). The server stops when the actor is released."""
        server = self._direct_server
        return server is not None and server.serving and server.token.hex() == token

    def create_table(self, name: str, config: TableConfig, capacity: int = 1024) -> None:
        with self._lock:
            if name in self._tables:
                raise ValueError(f"table {name!r} already exists on shard {self.shard_index}")
            kind = EmbeddingTable if isinstance(config, EmbeddingTableConfig) else FeatureTable
            self._tables[name] = kind(config, capacity)

    def table_configs(self) -> dict[str, TableConfig]:
        with self._lock:
            return {name: table.config for name, table in self._tables.items()}

    def lookup(self, name: str, keys: np.ndarray, insert_missing: bool):
        # a lookup counts, may insert rows and applies cached gradients; only an inserting one
        # waits for durability (the others' records become durable with the next write)
        return self._acknowledged("lookup", name, keys, insert_missing, wait=bool(insert_missing))

    def update(self, name: str, keys: np.ndarray, values: Any, version: int) -> None:
        self._acknowledged("update", name, keys, values, version)

    def apply_gradients(self, name: str, keys: np.ndarray, gradients: np.ndarray,
                        push_id: int | None = None) -> None:
        # a push whose id this shard applied already is acknowledged and skipped; its record is
        # logged all the same, and a replay skips it the same way (the ids are rebuilt in order)
        self._acknowledged("apply_gradients", name, keys, gradients, push_id)

    def nearest(self, name: str, queries: np.ndarray, k: int, metric: str,
                exclude: np.ndarray | None, exact: bool | None):
        with self._lock:
            table, _ = self._table(name)
            return table.nearest(queries, k, metric, exclude, exact)

    def sample(self, name: str, n: int, seed: int) -> tuple[np.ndarray, int]:
        with self._lock:
            table, _ = self._table(name)
            rng = np.random.default_rng([seed, self.shard_index])
            return table.sample(n, rng), table.num_rows

    def row_metadata(self, name: str, keys: np.ndarray) -> dict[str, np.ndarray]:
        with self._lock:
            table, _ = self._table(name)
            return table.metadata(keys)

    def flush(self, name: str | None = None) -> None:
        self._acknowledged("flush", name)

    def stats(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {name: self._table(name)[0].stats() for name in list(self._tables)}

    def max_version(self) -> int:
        """The largest version any update has written (-1 if none): automatic snapshots."""
        with self._lock:
            return max([table.max_version for table in self._tables.values()], default=-1)

    # ----- snapshots and the write-ahead log (carlskit.bank._snapshot, carlskit.bank._wal)
    def write_snapshot_parts(self, url: str, save_id: str, names: list[str],
                             wal_directory: str | None, durability: str = "process") -> dict[str, Any]:
        """Write this shard's part of every table in ``names`` (numbered in that order) to the
        snapshot directory ``url``, all under the shard's lock (one moment of this shard). With
        ``wal_directory``, a new write-ahead log segment starts at exactly this moment."""
        location = Location(url)
        with self._lock:
            parts = {}
            for number, name in enumerate(names):
                table = self._tables[name]
                columns, meta = table.snapshot_columns()
                part = write_part(location, part_file_name(save_id, number, self.shard_index),
                                  columns)
                parts[name] = {**part, **meta, "counters": dict(table.counters),
                               "pushes": list(self._pushes.get(name, ()))}
            segment = None
            if wal_directory is not None:
                segment = (self._wal.segment + 1 if self._wal is not None
                           and self._wal.wal_directory == wal_directory
                           else WriteAheadLog.next_segment(wal_directory, self.shard_index))
                self._start_wal(wal_directory, segment, durability)
            return {"parts": parts, "wal_segment": segment}

    def _start_wal(self, wal_directory: str | None, segment: int | None, durability: str = "process") -> None:
        if self._wal is not None:
            self._wal.close()
            self._wal = None
        if wal_directory is not None:
            self._wal = WriteAheadLog(wal_directory, self.shard_index, segment, durability)

    def stop_write_ahead_log(self) -> None:
        with self._lock:
            self._start_wal(None, None)

    def import_snapshot(self, url: str, plan: list[tuple[str, list[dict], dict | None, bool]]) -> None:
        """Load snapshot parts into this shard's (empty, created) tables. ``plan``: per table
        (name, parts, counters to add or None, same_layout): with ``same_layout`` the one part is
        this shard's own (read straight into the table); else every part is streamed and the rows
        routed to this shard are kept. Every part's bytes are checked against its SHA-256."""
        location = Location(url)
        with self._lock:
            for name, parts, counters, same_layout in plan:
                table = self._tables[name]
                pending = []
                for part in parts:
                    reader = PartReader(location, part)
                    try:
                        pending.append(table.restore_part(reader) if same_layout else
                                       table.reroute_part(reader, self.shard_index,
                                                          self.num_shards))
                    finally:
                        reader.close()
                table.import_pending(pending)
                if same_layout:  # this shard's own part: the pushes it had applied (a re-send skips them)
                    self._pushes[name] = collections.OrderedDict.fromkeys(parts[0].get("pushes", ()))
                for key, value in (counters or {}).items():
                    table.counters[key] = table.counters.get(key, 0) + int(value)

    def replay_write_ahead_log(self, wal_directory: str, first_segment: int, durability: str = "process") -> int:
        """Apply every logged call since the snapshot this shard was loaded from (segments from
        ``first_segment`` on), each at its logged time; then log on in a new segment. Returns the
        number of calls replayed."""
        with self._lock:
            count = 0
            for method, now, args in records_since(wal_directory, self.shard_index, first_segment):
                try:
                    self._apply(method, now, *args)
                except (ValueError, TypeError, KeyError, IndexError):
                    # the live call raised the same error to its caller (it was logged before it
                    # was applied): it failed then, it fails now, and the rest still applies
                    continue
                count += 1
            self._start_wal(wal_directory, WriteAheadLog.next_segment(wal_directory, self.shard_index),
                            durability)
            return count
