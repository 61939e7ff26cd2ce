"""One shard of a knowledge bank: a plain in-process object, or a Dask actor on a worker.

Every method handles a whole batch for one table and is guarded by a lock, so the same object is
safe as a threaded in-process shard and as an actor (Dask runs one actor method at a time anyway).
Input is validated by the client before any shard is called; the shard trusts it.
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any, Callable

import numpy as np

from ._tables import EmbeddingTable, FeatureTable, RowStore


#: glibc ``mallopt`` parameters and the values a shard's worker process gets (see below).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_BYTES = 32 << 20
_TRIM_THRESHOLD_BYTES = 64 << 20


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

    def _table(self, name: str) -> tuple[RowStore, float]:
        table = self._tables[name]
        now = self._clock()
        table.maintain(now)
        return table, now

    def ping(self) -> int:
        return self.shard_index

    def open_direct_path(self, host: str | None = None) -> dict[str, str] | None:
        """Start serving the batch methods on a ZeroMQ socket beside the actor (see
        :mod:`carlskit.bank._direct`); its address, or None where the worker does not speak plain
        tcp or ``host`` (default: the worker's contact host) cannot be bound (the bank then keeps
        to Dask's RPC)."""
        import zmq

        from ._direct import DirectServer, worker_host

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

    def create_table(self, name: str, config: dict[str, Any], capacity: int = 1024) -> None:
        with self._lock:
            if name in self._tables:
                raise ValueError(f"table {name!r} already exists on shard {self.shard_index}")
            kind = EmbeddingTable if config["kind"] == "embedding" else FeatureTable
            self._tables[name] = kind(config, capacity)

    def table_configs(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {name: table.config for name, table in self._tables.items()}

    def lookup(self, name: str, keys: np.ndarray, insert_missing: bool):
        with self._lock:
            table, now = self._table(name)
            return table.lookup(keys, insert_missing, now)

    def update(self, name: str, keys: np.ndarray, values: Any, version: int) -> None:
        with self._lock:
            table, now = self._table(name)
            table.update(keys, values, version, now)

    def apply_gradients(self, name: str, keys: np.ndarray, gradients: np.ndarray) -> None:
        with self._lock:
            table, now = self._table(name)
            table.apply_gradients(keys, gradients, now)

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
        with self._lock:
            now = self._clock()
            for table_name in [name] if name is not None else list(self._tables):
                self._tables[table_name].flush_all(now)

    def stats(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            now = self._clock()
            out = {}
            for name, table in self._tables.items():
                table.maintain(now)
                out[name] = table.stats()
            return out

    def export_tables(self) -> dict[str, dict[str, Any]]:
        """Every table's used rows, pending gradients and counters (for snapshots)."""
        with self._lock:
            return {name: {"arrays": table.export(), "counters": dict(table.counters)}
                    for name, table in self._tables.items()}

    def import_table(self, name: str, arrays: dict[str, np.ndarray],
                     counters: dict[str, int] | None) -> None:
        with self._lock:
            table = self._tables[name]
            table.import_rows(arrays)
            if isinstance(table, EmbeddingTable) and "pending_keys" in arrays:
                table.import_pending(arrays["pending_keys"], arrays["pending_gradients"],
                                     arrays["pending_times"])
            if counters:
                for key, value in counters.items():
                    table.counters[key] = table.counters.get(key, 0) + int(value)

    def import_tables(self, payload: dict[str, dict[str, Any]]) -> None:
        for name, item in payload.items():
            self.import_table(name, item["arrays"], item.get("counters"))
