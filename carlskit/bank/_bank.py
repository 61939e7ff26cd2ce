"""KnowledgeBank: the client of a sharded store of embeddings and feature records (CARLS 3.2).

A facade: it validates every call completely (bad input raises before anything is sent), then hands
it to its shard set (:mod:`carlskit.bank._transport`: routing by ``splitmix64(key) mod
num_shards``, exactly one call per shard per batch, lost shards recognised by type and rebuilt) or
to the snapshot functions (:mod:`carlskit.bank._snapshot`: format, save, load, recovery source);
table options are the typed configs of :mod:`carlskit.bank._config`. Without a Dask client the
shards are plain objects in this process; with one, each shard is a Dask actor pinned to a worker,
and the calls to different shards are issued together, then awaited, so shards work concurrently.
On a plain-tcp cluster the batch calls (lookup, update, apply_gradients, row_metadata) travel on the
direct path of :mod:`carlskit.bank._direct` (a ZeroMQ socket per shard beside its actor: 0.5 ms
round trip to both shards against 2.1 ms through Dask's actor RPC); everything else uses the actor.
``lookup_async`` and ``apply_gradients_async`` return a :class:`BankFuture` right after sending, so
a caller can keep several batches in flight. The lazy gradient rule is documented in
:mod:`carlskit.bank` and :mod:`carlskit.bank._lazy`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
import weakref
from typing import Any, Callable

import numpy as np

from carlskit._checks import INT64_MAX, INT64_MIN, choice, integer, positive_float, utf8
from carlskit.bank import _snapshot as snapshots
from carlskit.bank._config import EmbeddingTableConfig, FeatureTableConfig, TableConfig
from carlskit.bank._hashing import key_from_string
from carlskit.bank._nearest import METRICS, top_k
from carlskit.bank._snapshot import Location, SnapshotSeries, read_manifest
from carlskit.bank._transport import BankFuture, ShardLostError, ShardSet
from carlskit.bank._wal import DURABILITY
from carlskit.cluster import Placement

__all__ = ["KnowledgeBank", "BankFuture", "ShardLostError"]

#: Sane upper bounds of size arguments (a clear ValueError instead of a MemoryError): rows are
#: int32 inside a shard (a row's width is at most ``_config.MAX_WIDTH``); ``capacity`` is a
#: preallocation hint of which at most PREALLOCATED_ROWS rows per shard are allocated up front
#: (tables grow geometrically beyond); ``nearest`` returns at most MAX_NEAREST_RESULTS = nq * k
#: results per shard (12 bytes each); ``sample`` draws at most MAX_SAMPLE keys per call.
MAX_ROWS_PER_SHARD = 2**31 - 1
PREALLOCATED_ROWS = 1 << 22
MAX_NEAREST_RESULTS = 1 << 27
MAX_SAMPLE = 1 << 26


# ----------------------------------------------------------------------------- validation helpers
def _to_array(value: Any, name: str, shape: str) -> np.ndarray:
    """``np.asarray(value)``, with numpy's error for ragged nested sequences naming ``name``."""
    try:
        return np.asarray(value)
    except (ValueError, TypeError) as error:
        raise ValueError(f"{name} must be an array of shape {shape}, got a ragged or "
                         f"unconvertible {type(value).__name__} ({error})") from error


def _as_keys(keys: Any, name: str = "keys") -> np.ndarray:
    """int64 [n] keys; strings are mapped with :func:`key_from_string`; -1 is rejected."""
    array = _to_array(keys, name, "[n]")
    if array.ndim != 1:
        raise ValueError(f"{name} must have shape [n], got shape {array.shape}")
    if array.dtype.kind in "UO" and len(array):
        # numpy turns [1, "a"] into the strings ["1", "a"]: check the items as given
        items = keys.tolist() if isinstance(keys, np.ndarray) and keys.dtype.kind == "U" else (
            np.asarray(keys, dtype=object).tolist())
        wrong = next((item for item in items if not isinstance(item, str)), None)
        if wrong is not None and all(isinstance(item, int) and not isinstance(item, bool) for item in items):
            huge = next((item for item in items if not INT64_MIN <= item <= INT64_MAX), wrong)
            raise ValueError(f"{name} must be int64 ids, got {huge!r} beyond [-2**63, 2**63 - 1]")
        if wrong is not None:
            raise TypeError(f"{name} must be all int64 ids or all strings, got "
                            f"{type(wrong).__name__} {wrong!r} among strings")
        for item in items:
            utf8(item, name)
        return key_from_string(items)
    if len(array) == 0 and array.dtype.kind not in "iu":
        array = array.astype(np.int64)
    if array.dtype.kind not in "iu":
        raise TypeError(f"{name} must be integer ids (int64) of shape [n], got dtype {array.dtype}")
    if array.dtype == np.uint64 and len(array) and array.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{name} must fit in int64")
    array = np.ascontiguousarray(array, dtype=np.int64)
    if (array == -1).any():
        raise ValueError(f"{name} contains -1, which is reserved for 'no key'")
    return array


def _as_matrix(values: Any, rows: int, width: int, name: str, dtype: Any = np.float32,
               finite: bool = True) -> np.ndarray:
    """A [rows, width] array of ``dtype``; rejects wrong rank/shape, bool/object data, NaN/Inf."""
    array = _to_array(values, name, f"[{rows}, {width}]")
    target = np.dtype(dtype)
    accepted = {"f": "iuf", "i": "iu", "u": "iu", "b": "b"}[target.kind]
    if array.dtype.kind not in accepted:
        expected = {"f": "a numeric", "i": "an integer", "u": "an integer", "b": "a bool"}[target.kind]
        raise TypeError(f"{name} must be {expected} array of shape [{rows}, {width}], "
                        f"got dtype {array.dtype}")
    if array.shape != (rows, width):
        raise ValueError(f"{name} must have shape [{rows}, {width}], got shape {array.shape}")
    if target.kind in "iu" and array.size and not np.can_cast(array.dtype, target):
        low, high = np.iinfo(target).min, np.iinfo(target).max
        if array.min() < low or array.max() > high:  # the cast would wrap around silently
            raise ValueError(f"{name} has values outside the range of {target} [{low}, {high}]: "
                             f"min {array.min()}, max {array.max()}")
    array = np.ascontiguousarray(array, dtype=dtype)
    if finite and array.dtype.kind == "f" and not np.isfinite(array).all():
        raise ValueError(f"{name} contains NaN or Inf, or values beyond the {target} range "
                         f"(shape [{rows}, {width}])")
    return array



def _detached(array: np.ndarray, copy: bool) -> np.ndarray:
    """``array``, copied when ``copy``: an asynchronous call must not see the caller's later
    writes to a buffer it passed in (Dask serializes the arguments after the call returns)."""
    return array.copy() if copy else array


def _owned(value: Any) -> Any:
    """``value`` with read-only arrays (views of received message buffers) copied, so a caller
    may write into what the bank returns."""
    if isinstance(value, np.ndarray):
        return value if value.flags.writeable else value.copy()
    if isinstance(value, tuple):
        return tuple(_owned(item) for item in value)
    if isinstance(value, dict):
        return {key: _owned(item) for key, item in value.items()}
    return value



def _in_key_order(routes: list[tuple[int, np.ndarray | None]], n: int, parts: dict[int, Any]) -> Any:
    """Per-shard results (arrays, tuples or dicts of them, one row per key sent) back in the
    caller's order of its ``n`` keys (``routes``: :meth:`ShardSet.route`)."""
    first = parts[routes[0][0]]
    if routes[0][1] is None:  # one shard had every key, in order
        return _owned(first)
    if isinstance(first, (tuple, dict)):
        names = range(len(first)) if isinstance(first, tuple) else list(first)
        merged = [_in_key_order(routes, n, {s: part[name] for s, part in parts.items()}) for name in names]
        return tuple(merged) if isinstance(first, tuple) else dict(zip(names, merged))
    out = np.empty((n,) + first.shape[1:], first.dtype)
    for s, pos in routes:
        out[pos] = parts[s]
    return out


def _merge_lookups(config: TableConfig, n: int, routes: list[tuple[int, np.ndarray | None]],
                   results: dict[int, Any]):
    """Per-shard lookup results back in the caller's key order."""
    if routes:
        return _in_key_order(routes, n, results)
    if isinstance(config, EmbeddingTableConfig):  # no keys, several shards: empty arrays
        return np.empty((0, config.dim), np.float32), np.empty(0, bool)
    return {field: np.empty((0, width), np.dtype(dtype)) for field, dtype, width in config.schema}, np.empty(0, bool)


class KnowledgeBank:
    """A sharded store of embeddings and feature records shared by trainers and makers.

    ``KnowledgeBank(client=None, num_shards=1)``: without a Dask client every shard lives in this
    process; with one, shard i is a Dask actor on worker ``i mod n_workers``. A client made with
    ``Client(..., direct_to_workers=True)`` sends shard calls straight to the workers instead of
    through the scheduler (lower latency per call). ``direct=True`` (default) sends the batch calls
    on a ZeroMQ socket per shard where the cluster speaks plain tcp (:attr:`transport` says which
    path is in use; TLS clusters keep to Dask's comm). Keys are int64 ids
    (-1 is reserved for "no key"); string keys are mapped by :func:`key_from_string`
    (blake2b, 63 bits). Initial values are a function of (seed, key) only, so every shard and
    restart agrees. Per row the bank keeps the version of the last ``update``, the time of the last
    write and a lookup count (:meth:`row_metadata`).

    Args:
      client: a ``distributed.Client`` or None (in-process shards).
      num_shards: number of shards; keys go to shard ``splitmix64(key) mod num_shards``.
      clock: seconds-returning callable used for write times and ttl flushes (default
        ``time.time``); a deterministic clock makes ttl tests exact.
      direct: use the direct data path when the cluster allows it (False: Dask actor RPC only).
      workers, resources: where the shards may live (:class:`carlskit.cluster.Placement`: worker
        addresses or names, and/or Dask resources the worker must offer, e.g. ``{"bank": 1}``);
        shard i goes to the i-th matching worker (round robin), and a shard rebuilt by
        :meth:`recover` stays within the same placement. By default shards stay off accelerator
        workers when there are others.
    """

    def __init__(self, client: Any = None, num_shards: int = 1, *,
                 clock: Callable[[], float] | None = None, direct: bool = True,
                 workers: list[str] | str | None = None, resources: dict[str, float] | None = None) -> None:
        num_shards = integer(num_shards, "num_shards", minimum=1)
        if not isinstance(direct, bool):
            raise TypeError(f"direct must be a bool, got {type(direct).__name__}")
        if clock is not None and not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds, "
                            f"got {type(clock).__name__}")
        placement = Placement.of(workers, resources)
        if client is None and placement.restricted:
            raise ValueError("workers/resources place shards on a Dask cluster: pass a client too")
        self._adopt(ShardSet.start(client, num_shards, clock, direct, placement), {})

    @classmethod
    def _over(cls, shards: ShardSet, tables: dict[str, TableConfig] | None = None) -> "KnowledgeBank":
        """A bank over an existing shard set and its known tables (:meth:`attach`, unpickling): the
        private constructor path, so the public signature carries no private parameters."""
        bank = cls.__new__(cls)
        bank._adopt(shards, tables or {})
        return bank

    def _adopt(self, shards: ShardSet, tables: dict[str, TableConfig]) -> None:
        self._shards = shards
        self._shards.owner = weakref.ref(self)  # named by the ShardLostErrors it raises
        self._configs: dict[str, TableConfig] = dict(tables)
        self._snapshots = snapshots.BankSnapshots()

    # ------------------------------------------------------------------ shards
    @property
    def num_shards(self) -> int:
        return len(self._shards)

    @property
    def shard_workers(self) -> list[str | None]:
        """Address of the worker holding each shard (None for in-process shards)."""
        return list(self._shards.workers)

    @property
    def distributed(self) -> bool:
        return self._shards.remote

    @property
    def transport(self) -> str:
        """How batch calls reach the shards: ``"in-process"``, ``"direct"`` (ZeroMQ sockets beside
        the Dask actors, :mod:`carlskit.bank._direct`) or ``"dask"`` (actor RPC only: the cluster
        does not speak plain tcp, or ``direct=False``)."""
        return self._shards.transport

    def ping(self) -> float:
        """Seconds for one round trip to every shard at once (raises ShardLostError naming a
        shard that does not answer): the fixed cost each batched call pays."""
        start = time.perf_counter()
        self._shards.call_all("ping")
        return time.perf_counter() - start

    def _routed(self, keys: np.ndarray, detach: bool = False) -> tuple[list, dict[int, np.ndarray]]:
        """The routes of ``keys`` (:meth:`ShardSet.route`) and the keys each shard gets; with
        ``detach``, copied where the call would otherwise send the caller's own array."""
        routes = self._shards.route(keys)
        whole = _detached(keys, detach and self._shards.remote)
        return routes, {s: whole if pos is None else keys[pos] for s, pos in routes}

    def _config(self, table: Any) -> TableConfig:
        self._shards.require_open()
        if not isinstance(table, str):
            raise TypeError(f"table must be a table name (str), got {type(table).__name__}")
        if table not in self._configs:
            self._all_configs()  # created elsewhere?
        if table not in self._configs:
            raise ValueError(f"unknown table {table!r}; tables: {sorted(self._configs)}")
        return self._configs[table]

    def _embedding_config(self, table: str, operation: str) -> EmbeddingTableConfig:
        config = self._config(table)
        if not isinstance(config, EmbeddingTableConfig):
            raise ValueError(f"{operation} needs an embedding table; {table!r} is a feature table")
        return config

    # ------------------------------------------------------------------ tables
    def _create(self, name: str, config: TableConfig, capacity: int = 1024) -> None:
        if not isinstance(name, str):
            raise TypeError(f"name must be a non-empty str, got {type(name).__name__}")
        if not name:
            raise ValueError("name must be a non-empty str, got ''")
        utf8(name, "name")
        if name in self._configs or name in self._all_configs():
            raise ValueError(f"table {name!r} already exists")
        per_shard = min(max(16, -(-capacity // self.num_shards)), PREALLOCATED_ROWS)
        self._shards.call_all("create_table", name, config, per_shard)
        self._configs[name] = config

    def create_table(self, name: str, *args: Any, capacity: int = 1024, **options: Any) -> None:
        """Create an embedding table of float32 rows: ``create_table(name, dim, initializer="normal",
        seed=0, **options)``, the options of :class:`carlskit.bank.EmbeddingTableConfig` (an unknown
        or bad one: TypeError/ValueError naming it, nothing created); or ``create_table(name,
        config)`` with a config object built beforehand (an :class:`~carlskit.bank.EmbeddingTableConfig`,
        whose options an editor's signature help shows, or a :class:`~carlskit.bank.FeatureTableConfig`).

        Options:
          dim: the row width.
          initializer: ``zeros`` | ``normal`` (N(0, init_scale^2)) | ``uniform``
            (U(-init_scale, init_scale)); ``init_scale`` defaults to 1/sqrt(dim). Deterministic in
            (seed, key).
          optimizer: ``sgd`` (v -= lr g, ``learning_rate``) or ``adagrad`` (a += g^2; v -= lr g /
            sqrt(a + epsilon), a starting at ``initial_accumulator_value``), applied to averaged
            cached gradients.
          max_pending, pending_ttl_seconds, outlier_threshold: the lazy update rule (module doc).
          index: ``flat`` (exact only) or ``hnsw`` (approximate search for ``index_metric``, with
            ``hnsw_m`` and ``hnsw_ef_search``, kept current incrementally; exact search stays
            available with ``exact=True``).
          min_count: a ``lookup(insert_missing=True)`` creates a key's row only from its
            ``min_count``-th such call on; before, it reads the initializer's value, has no row and
            its gradients are dropped (admission).
          max_idle_seconds, max_rows_per_shard: evict rows not accessed for that long, and the least
            recently accessed beyond that many rows per shard (down to 90% of it); see
            :class:`carlskit.bank._tables.EmbeddingTable`. Need ``index="flat"``.
          capacity: expected rows (preallocation hint only).
        """
        if args and isinstance(args[0], TableConfig):
            if len(args) > 1 or options:
                raise TypeError("create_table(name, config) takes no other options: they are the config's")
            config = args[0]
        else:
            config = EmbeddingTableConfig(*args, **options)
        self._create(name, config, self._capacity(capacity))

    def create_feature_table(self, name: str, schema: dict[str, tuple[str, int]], *,
                             capacity: int = 1024) -> None:
        """Create a table of fixed-width records, e.g. ``{"ids": ("int64", 32), "weights":
        ("float32", 32)}``. Absent fields read as -1 (signed integers), the largest value (unsigned
        integers), 0 (floats) or False (bool)."""
        self._create(name, FeatureTableConfig(schema), self._capacity(capacity))

    def _capacity(self, capacity: Any) -> int:
        return integer(capacity, "capacity", minimum=1,
                       maximum=MAX_ROWS_PER_SHARD * self.num_shards,
                       why=f" ({MAX_ROWS_PER_SHARD} rows per shard: rows are int32)")

    @property
    def tables(self) -> dict[str, dict[str, Any]]:
        """Configuration of every table as a dict (``{"kind": ..., option: value}``, new on every
        call: editing it changes nothing in the bank)."""
        return {name: config.to_dict() for name, config in self._all_configs().items()}

    def table_config(self, name: str, kind: str | None = None, fields: tuple[str, ...] = ()) -> TableConfig:
        """The typed config of table ``name``: an :class:`~carlskit.bank.EmbeddingTableConfig` or a
        :class:`~carlskit.bank.FeatureTableConfig` (frozen; ``.dim``, ``.fields[field] == (dtype,
        width)``...). ``ValueError`` unless the table exists, is of ``kind`` (``"embedding"`` or
        ``"feature"``, when given) and, for a feature table, has exactly ``fields`` (when given)."""
        configs = self._all_configs()
        if name not in configs:
            raise ValueError(f"the bank has no table {name!r} (tables: {sorted(configs)})")
        config = configs[name]
        wanted = f"a feature table with fields {' and '.join(fields)}" if fields else \
            f"{'an' if kind == 'embedding' else 'a'} {kind} table"
        if kind is not None and config.kind != kind:
            raise ValueError(f"table {name!r} must be {wanted}, got {'an' if config.kind == 'embedding' else 'a'} "
                             f"{config.kind} table")
        if fields and (config.kind != "feature" or set(config.fields) != set(fields)):
            got = sorted(config.fields) if config.kind == "feature" else "no fields"
            raise ValueError(f"table {name!r} must be {wanted}, got fields {got}")
        return config

    def _all_configs(self, shard: int = 0) -> dict[str, TableConfig]:
        """Every table's config, as shard ``shard`` knows them (tables may be created elsewhere)."""
        self._configs.update(self._shards.call("table_configs", {shard: ()})[shard])
        return dict(self._configs)

    # ------------------------------------------------------------------ data path
    def lookup(self, table: str, keys: Any, insert_missing: bool = False):
        """Values of ``keys``: (float32 [n, dim], found bool [n]) for embedding tables,
        ({field: [n, width]}, found) for feature tables. Flushes the keys' cached gradients first.
        Absent keys read as zeros (fill values) unless ``insert_missing`` inserts them with their
        initial value; ``found`` says whether each key existed before the call."""
        pending, finish, sent = self._send_lookup(table, keys, insert_missing, detach=False)
        return finish(self._shards.collect(pending, sent))

    def lookup_async(self, table: str, keys: Any, insert_missing: bool = False) -> "BankFuture":
        """:meth:`lookup` without waiting: the shard calls are sent now and ``.result()`` returns
        what :meth:`lookup` returns. Keeping a few batches in flight hides the Dask round trip
        (one call per shard per batch); bad input raises here, before anything is sent. The keys
        are copied, so the caller may reuse its buffer at once. Calls in flight together may reach
        a shard in any order; a lookup sees every write whose ``result()`` returned before it was
        issued. In-process banks compute at once."""
        pending, finish, sent = self._send_lookup(table, keys, insert_missing, detach=True)
        return BankFuture(self._shards, pending, finish, sent)

    def _send_lookup(self, table: str, keys: Any, insert_missing: bool,
                     detach: bool) -> tuple[dict[int, Any], Callable[[dict[int, Any]], Any], dict]:
        """Validate, route and send a lookup: (pending shard calls, merge of their results, the
        keys sent to each shard)."""
        config = self._config(table)
        keys = _as_keys(keys)
        if not isinstance(insert_missing, (bool, np.bool_)):
            raise TypeError(f"insert_missing must be a bool, got {type(insert_missing).__name__}")
        routes, sent = self._routed(keys, detach)
        pending = self._shards.submit("lookup", {s: (table, sent[s], bool(insert_missing))
                                                 for s, _ in routes})
        return pending, lambda results: _merge_lookups(config, len(keys), routes, results), sent

    def update(self, table: str, keys: Any, values: Any, version: int = 0) -> None:
        """Write ``values`` ([n, dim] float, or {field: [n, width]}) for ``keys`` with the model
        ``version`` that computed them. Later duplicates win; cached gradients of the keys are
        discarded. NaN/Inf values are rejected (ValueError) and nothing is written."""
        config = self._config(table)
        keys = _as_keys(keys)
        version = integer(version, "version", minimum=0)  # -1 marks "never updated"
        if isinstance(config, EmbeddingTableConfig):
            values = _as_matrix(values, len(keys), config.dim, "values")
            pick = lambda v, pos: v[pos]  # noqa: E731
        else:
            fields = [field for field, _, _ in config.schema]
            if not isinstance(values, dict) or set(values) != set(fields):
                raise ValueError(f"values must be a dict with fields {sorted(fields)}")
            values = {field: _as_matrix(values[field], len(keys), width, f"values[{field!r}]",
                                        dtype=np.dtype(dtype))
                      for field, dtype, width in config.schema}
            pick = lambda v, pos: {f: a[pos] for f, a in v.items()}  # noqa: E731
        routes, sent = self._routed(keys)
        self._shards.call("update", {
            s: (table, keys, values, version) if pos is None else
            (table, sent[s], pick(values, pos), version) for s, pos in routes}, sent)

    def apply_gradients(self, table: str, keys: Any, gradients: Any, *,
                        push_id: int | None = None) -> None:
        """Cache gradients ([n, dim]) for ``keys``; they are applied lazily (module docstring):
        averaged with NaN/Inf and outlier gradients dropped, then one optimizer step per key.
        Keys not yet present are inserted with their initial value.

        ``push_id`` (an int in [0, 2**63), unique per push, e.g. ``secrets.randbits(63)``) makes a
        re-send count once: a shard skips a push whose id it applied among its last
        ``PUSHES_KEPT`` (1024) of the table. The ids are in its write-ahead log and snapshots, so
        after a :class:`ShardLostError` and ``recover()``, re-sending the ``unapplied_keys`` with the
        same id applies exactly the gradients the lost shard had not logged. Without an id a re-send
        of a logged push counts twice."""
        self._shards.collect(*self._send_gradients(table, keys, gradients, push_id, detach=False))

    def apply_gradients_async(self, table: str, keys: Any, gradients: Any, *,
                              push_id: int | None = None) -> "BankFuture":
        """:meth:`apply_gradients` without waiting; ``.result()`` (None) waits for the shards and
        raises their errors. Inputs are validated and copied before anything is sent; ordering
        as in :meth:`lookup_async`."""
        pending, sent = self._send_gradients(table, keys, gradients, push_id, detach=True)
        return BankFuture(self._shards, pending, lambda results: None, sent)

    def _send_gradients(self, table: str, keys: Any, gradients: Any, push_id: int | None,
                        detach: bool) -> tuple[dict[int, Any], dict[int, np.ndarray]]:
        """Validate, route and send gradients; the pending shard calls and the keys each got."""
        config = self._embedding_config(table, "apply_gradients")
        if push_id is not None:
            push_id = integer(push_id, "push_id", minimum=0, maximum=2 ** 63 - 1)
        keys = _as_keys(keys)
        gradients = _as_matrix(gradients, len(keys), config.dim, "gradients", finite=False)
        routes, sent = self._routed(keys, detach)
        detach = detach and self._shards.remote
        return self._shards.submit("apply_gradients", {
            s: (table, sent[s], _detached(gradients, detach), push_id) if pos is None else
            (table, sent[s], gradients[pos], push_id) for s, pos in routes}), sent

    def flush(self, table: str | None = None) -> None:
        """Apply every cached gradient now (of one table, or of all)."""
        if table is not None:
            self._embedding_config(table, "flush")
        self._shards.call_all("flush", table)

    def nearest(self, table: str, queries: Any, k: int = 10, metric: str = "dot", *,
                exclude: Any = None, exact: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Top-k keys and scores per query ([nq, k] int64, [nq, k] float32), best first.

        ``dot``: <q, v>; ``cosine``: <q, v>/(|q||v|) (larger is better); ``l2``: |q - v|^2
        (smaller is better). Exact by default (faiss flat kNN per shard, merged); a table created
        with ``index="hnsw"`` answers approximately for its ``index_metric`` unless
        ``exact=True``. ``exclude``: keys to drop, [nq] (e.g. the query's own key) or [nq, m];
        -1 entries exclude nothing. Missing results: key -1. Reflects every write so far.
        Cached (not yet applied) gradients are not part of the searched values. Inside Dask
        workers ``OMP_NUM_THREADS=1``, so each shard's faiss search is single-threaded and the
        shards run in parallel.
        """
        config = self._embedding_config(table, "nearest")
        queries = _to_array(queries, "queries", f"[nq, {config.dim}]")
        if queries.ndim != 2:
            raise ValueError(f"queries must have shape [nq, {config.dim}], got {queries.shape}")
        queries = _as_matrix(queries, queries.shape[0], config.dim, "queries")
        k = integer(k, "k", minimum=1, maximum=max(1, MAX_NEAREST_RESULTS // max(1, len(queries))),
                    why=f" (at most {MAX_NEAREST_RESULTS} results: nq * k, nq = {len(queries)})")
        metric = choice(metric, "metric", METRICS)
        if exact not in (None, True, False):
            raise TypeError("exact must be None, True or False")
        if exclude is not None:
            exclude = _to_array(exclude, "exclude", "[nq] or [nq, m]")
            if exclude.ndim == 1:
                exclude = exclude[:, None]
            if exclude.ndim != 2 or exclude.shape[0] != len(queries) or exclude.dtype.kind not in "iu":
                raise ValueError(f"exclude must be int keys of shape [{len(queries)}] or "
                                 f"[{len(queries)}, m], got {exclude.dtype} {exclude.shape}")
            if (exclude.dtype == np.uint64 and exclude.size
                    and exclude.max() > np.iinfo(np.int64).max):
                raise ValueError("exclude must fit in int64")
            exclude = exclude.astype(np.int64)
        results = self._shards.call_all("nearest", table, queries, k, metric, exclude, exact)
        if len(results) == 1:
            return results[0]
        keys = np.concatenate([r[0] for r in results], axis=1)
        scores = np.concatenate([r[1] for r in results], axis=1)
        return top_k(keys, scores, k, metric)

    def sample(self, table: str, n: int, seed: int = 0) -> np.ndarray:
        """``n`` keys drawn uniformly with replacement from all rows (e.g. contrastive negatives);
        deterministic in ``seed`` for a given bank content and sharding."""
        self._config(table)
        n = integer(n, "n", minimum=0, maximum=MAX_SAMPLE)
        seed = integer(seed, "seed", minimum=0)
        results = self._shards.call_all("sample", table, n, seed)
        counts = np.array([count for _, count in results], dtype=np.float64)
        if counts.sum() == 0:
            raise ValueError(f"cannot sample from the empty table {table!r}")
        shard = np.random.default_rng(seed).choice(self.num_shards, size=n, p=counts / counts.sum())
        out = np.empty(n, dtype=np.int64)
        for s, (keys, _) in enumerate(results):
            chosen = shard == s
            out[chosen] = keys[: int(chosen.sum())]
        return out

    def row_metadata(self, table: str, keys: Any) -> dict[str, np.ndarray]:
        """Per key: ``found``, ``version`` (of the last update, -1 if none), ``last_write_time``
        (seconds, NaN if absent) and ``lookup_count``; one call per shard. Counts no lookup."""
        self._config(table)
        keys = _as_keys(keys)
        routes, sent = self._routed(keys)
        if not routes:  # no keys, several shards: ask one shard for empty columns
            routes, sent = [(0, None)], {0: keys}
        results = self._shards.call("row_metadata", {s: (table, sent[s]) for s in sent}, sent)
        return _in_key_order(routes, len(keys), results)

    def stats(self) -> dict[str, Any]:
        """Per table, summed over shards: rows (and ``rows_per_shard``), ``pending_gradients``,
        ``pending_keys``, ``min_version``/``max_version``, ``*_shard_calls`` (a batch that touches
        two shards counts two), rows looked up / inserted / updated, gradients received / applied,
        ``dropped_nonfinite``, ``dropped_outliers``, ``discarded_by_update``, ``optimizer_steps``,
        ``resident_bytes``; admission and eviction: ``keys_not_admitted`` (lookups of keys below
        ``min_count``), ``gradients_not_admitted``, ``rows_evicted_idle``, ``rows_evicted_capacity``;
        ``repeated_pushes_skipped`` (gradient pushes re-sent with an id a shard had applied)."""
        per_shard = self._shards.call_all("stats")
        tables: dict[str, Any] = {}
        for shard_stats in per_shard:
            for name, stats in shard_stats.items():
                total = tables.setdefault(name, {"rows_per_shard": []})
                total["rows_per_shard"].append(stats["rows"])
                for key, value in stats.items():
                    if key in ("min_version", "max_version"):
                        if value is not None:
                            pick = min if key == "min_version" else max
                            old = total.get(key)
                            total[key] = value if old is None else pick(old, value)
                        else:
                            total.setdefault(key, None)
                    else:
                        total[key] = total.get(key, 0) + value
        return {"num_shards": self.num_shards, "distributed": self.distributed,
                "transport": self.transport, "tables": tables}

    def status(self) -> dict[str, Any]:
        """A dashboard summary (the source protocol of :class:`carlskit.widgets.ClusterStatus`):
        shards, transport, one row per table (rows, pending gradients, version range) and the
        automatic snapshots' state (None when off; "restarting" with a reason while a snapshot
        fails, e.g. while a shard is lost)."""
        stats = self.stats()
        tables = [{"table": name, "rows": t["rows"], "rows_per_shard": t["rows_per_shard"],
                   "pending_gradients": t["pending_gradients"], "min_version": t["min_version"],
                   "max_version": t["max_version"]} for name, t in stats["tables"].items()]
        snapshots = self._snapshots.status()
        return {"shards": self.num_shards, "transport": self.transport, "tables": tables,
                "shard_workers": [{"shard": i, "worker": worker} for i, worker in enumerate(self._shards.workers)],
                "placement": str(self._shards.placement), "snapshots": snapshots}


    # ------------------------------------------------------------------ snapshots
    def save(self, path: str | os.PathLike) -> None:
        """Write a snapshot to ``path`` (a local or shared directory, or an fsspec URL such as
        ``memory://x`` or ``s3://bucket/x``): every shard writes its own part of every table from
        its own worker, in parallel (values, versions, write times, lookup counts, optimizer state,
        pending gradients; raw columns with a SHA-256 each, no pickle), then this process writes
        ``manifest.json`` (checksummed) as the commit point. Nothing passes through this process.

        A shard's part is one moment of that shard (it holds its lock while writing); see
        :mod:`carlskit.bank._snapshot` for what that means across shards. A save that fails
        half-way (a lost worker) leaves the snapshot that was at ``path`` loadable. ``path`` must
        be absent, an empty directory or an earlier snapshot (anything else: ValueError, nothing
        written)."""
        self._shards.require_open()
        snapshots.save(self._shards, self._all_configs(), Location(path))

    @classmethod
    def load(cls, path: str | os.PathLike, client: Any = None, num_shards: int | None = None, *,
             clock: Callable[[], float] | None = None, workers: list[str] | str | None = None,
             resources: dict[str, float] | None = None) -> "KnowledgeBank":
        """Restore a snapshot into ``num_shards`` shards (default: as saved), in-process or on
        ``client``'s workers: values, versions, write times, lookup counts, optimizer state and
        pending gradients exactly as saved. Each shard reads its own part (same shard count) or
        streams every part in bounded chunks keeping its rows (another shard count); nothing
        passes through this process. The manifest and every part's size are checked before any
        shard is built, every part's bytes against its SHA-256 while it is read: any damage raises
        :class:`carlskit.CorruptFileError` naming the file (an interrupted save too; a
        ValueError), and no bank is returned. FileNotFoundError when there is no snapshot.
        ``workers``/``resources`` place the shards as for the constructor."""
        location = Location(path)
        manifest = read_manifest(location)
        if num_shards is not None:
            num_shards = integer(num_shards, "num_shards", minimum=1)
        bank = cls(client, manifest["num_shards"] if num_shards is None else num_shards,
                   clock=clock, workers=workers, resources=resources)
        try:
            for entry in manifest["tables"]:
                bank._create(entry["name"], entry["config"])
            snapshots.load(bank._shards, manifest, location)
        except BaseException:
            bank.close()  # release the shards (Dask actors) of the half-built bank
            raise
        return bank

    def enable_snapshots(self, directory: str | os.PathLike, *, every_seconds: float | None = None,
                         every_versions: int | None = None, keep: int = 3,
                         write_ahead_log: bool = False, durability: str = "process",
                         poll_seconds: float = 1.0) -> str:
        """Keep snapshots of this bank in ``directory`` (``snapshot-NNNNNNNNNNNN`` folders, the
        newest ``keep`` kept) so that :meth:`recover` can rebuild a lost shard; takes the first
        one now and returns its path.

        Args:
          every_seconds: take one automatically when this many seconds passed since the last.
          every_versions: take one automatically once an ``update`` wrote a version at least this
            much above the largest version of the last snapshot. Both are checked every
            ``poll_seconds`` by a supervised background thread (:class:`LongRunningTasks`: a failed
            snapshot, e.g. while a shard is lost, is retried with backoff; see :meth:`status`).
          write_ahead_log: each shard also appends every call that changes it to a log in
            ``directory/wal`` before applying it (:mod:`carlskit.bank._wal`; a local or mounted
            shared directory), truncated at each snapshot, so :meth:`recover` replays a lost shard's
            acknowledged writes too. Costs a disk append per write (see BENCHMARKS.md).
          durability: what an acknowledged write of the log survives: ``"process"`` (default) the
            loss of the shard's worker process; ``"machine"`` the loss of its machine too (its
            page cache): every write waits for a group ``fdatasync`` covering its record
            (:mod:`carlskit.bank._wal`; its cost on ``apply_gradients`` is in BENCHMARKS.md).
        """
        self._shards.require_open()
        keep = integer(keep, "keep", minimum=1)
        if every_seconds is not None:
            every_seconds = positive_float(every_seconds, "every_seconds")
        if every_versions is not None:
            every_versions = integer(every_versions, "every_versions", minimum=1)
        poll_seconds = positive_float(poll_seconds, "poll_seconds")
        if not isinstance(write_ahead_log, bool):
            raise TypeError(f"write_ahead_log must be a bool, got {type(write_ahead_log).__name__}")
        choice(durability, "durability", DURABILITY)
        if durability == "machine" and not write_ahead_log:
            raise ValueError('durability="machine" needs write_ahead_log=True (it is the log\'s durability)')
        series = SnapshotSeries(directory, keep)
        if write_ahead_log and not series.location.local:
            raise ValueError(f"write_ahead_log needs a local or mounted shared directory (the "
                             f"shards append to files there), got {series.location.url!r}")
        self._snapshots.stop()
        with self._snapshots.lock:  # the first snapshot is there before a recover() can look
            self._snapshots.use(self._shards, series, write_ahead_log, durability)
            path = self.snapshot()
        if every_seconds is not None or every_versions is not None:
            self._snapshots.start(self.snapshot, lambda: max(self._shards.call_all("max_version")),
                                  every_seconds, every_versions, poll_seconds)
        return path

    def snapshot(self) -> str:
        """Take a snapshot into the directory of :meth:`enable_snapshots` now; its path. Older
        ones beyond ``keep`` (and write-ahead log segments they no longer need) are removed."""
        return self._snapshots.take(self._shards, self._all_configs())

    def latest_snapshot(self) -> str | None:
        """The newest intact snapshot of :meth:`enable_snapshots`' directory (None if none)."""
        series = self._snapshots.series
        return None if series is None else series.latest()

    @property
    def recoverable(self) -> bool:
        """Whether :meth:`recover` can rebuild a lost shard by itself: a distributed bank that
        created its shards and keeps snapshots (:meth:`enable_snapshots`)."""
        return self._shards.remote and self._shards.owned and self._snapshots.series is not None

    def lost_shards(self) -> list[int]:
        """Shards whose actor or worker is gone (each checked by its actor's state, then a ping)."""
        return self._shards.lost()

    def recover(self, snapshot: str | os.PathLike | None = None) -> dict[int, dict[str, Any]]:
        """Rebuild every lost shard alone, on a live worker, from a snapshot; the other shards
        keep their current contents. Explicit: the bank never does this behind a caller's back
        (``Trainer.fit`` calls it when a knowledge stage meets a :class:`ShardLostError`).

        The source is the latest intact snapshot of :meth:`enable_snapshots` (then, with
        ``write_ahead_log=True``, the lost shard's log since that snapshot is replayed, so no
        acknowledged write is lost), or ``snapshot`` (a path saved by this bank's shard count; no
        log replayed). Without the log a recovered shard holds what it held at the snapshot: its
        writes after it are lost (the other shards' are not).

        Returns ``{shard: {"worker", "snapshot", "rows", "replayed_calls", "seconds"}}`` ({} when
        no shard is lost). Raises ValueError when there is no snapshot to recover from, and
        :class:`carlskit.CorruptFileError` for a damaged one.
        """
        self._shards.require_open()
        if not self._shards.remote:
            return {}
        if not self._shards.owned:
            raise ValueError("recover() needs the bank that created the shards (not one attached "
                             "to them or unpickled in a task)")
        lost = self._shards.lost()
        if not lost:
            return {}
        with self._snapshots.lock:
            location, manifest, wal_directory = snapshots.recovery_source(
                self._snapshots.series, self._snapshots.wal_directory, snapshot, lost, self.num_shards)
            live = [i for i in range(self.num_shards) if i not in lost]
            configs = self._all_configs(live[0]) if live else dict(self._configs)
            report = {}
            for shard in lost:
                start = time.perf_counter()
                fill = functools.partial(snapshots.restore_shard, shard=shard, configs=configs,
                                         location=location, manifest=manifest, wal_directory=wal_directory,
                                         wal_durability=self._snapshots.wal_durability)
                worker, restored = self._shards.rebuild(shard, lost, fill)
                report[shard] = {"worker": worker, "snapshot": location.url, **restored,
                                 "seconds": time.perf_counter() - start}
            if self._snapshots.wal_directory is not None and wal_directory is None:
                # the rebuilt shard does not continue the log it was not replayed from: a fresh
                # snapshot is the base every shard's log starts from again
                self.snapshot()
        return report

    # ------------------------------------------------------------------ sharing and lifetime
    def publish(self, name: str) -> None:
        """Make this (distributed) bank reachable by other processes: ``KnowledgeBank.attach``."""
        self._shards.publish(name)

    @classmethod
    def attach(cls, client: Any, name: str) -> "KnowledgeBank":
        """The bank published under ``name`` by another process, through ``client``."""
        return cls._over(ShardSet.attach(client, name))

    def __reduce__(self):
        """A distributed bank pickles as handles to its actors (e.g. into a Dask task); the copy
        uses the Dask client of the process that unpickles it."""
        return (_unpickled, (self._shards, self._configs))

    def close(self) -> None:
        """Release the shard actors (distributed) or drop the in-process shards. A shard's
        direct server stops with its actor, once no bank (or published dataset) holds it."""
        self._snapshots.stop()
        if self._snapshots.wal_directory is not None and self._shards:
            # Closing must release every shard even when one is lost (its log file stays as it
            # was, which recover() would replay) or the bank is already closed (ValueError).
            with contextlib.suppress(ShardLostError, ValueError):
                self._shards.call_all("stop_write_ahead_log")
        self._shards.close()

    def __repr__(self) -> str:
        where = (f"{self.num_shards} Dask actors, {self.transport} data path" if self.distributed
                 else "in-process")
        return f"<KnowledgeBank: {self.num_shards} shards ({where}), tables={sorted(self._configs)}>"

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><td>{name}</td><td>{c.kind}</td><td>"
                       f"{c.dim if isinstance(c, EmbeddingTableConfig) else len(c.schema)}</td></tr>"
                       for name, c in sorted(self._configs.items()))
        return (f"<b>KnowledgeBank</b> {self.num_shards} shard(s), "
                f"{'distributed' if self.distributed else 'in-process'}"
                f"<table><tr><th>table</th><th>kind</th><th>dim / fields</th></tr>{rows}</table>")


def _unpickled(shards: ShardSet, tables: dict[str, TableConfig]) -> KnowledgeBank:
    """A bank unpickled (e.g. in a Dask task): handles to the same shards (:meth:`KnowledgeBank._over`)."""
    return KnowledgeBank._over(shards, tables)
