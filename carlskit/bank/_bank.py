"""KnowledgeBank: the client of a sharded store of embeddings and feature records (CARLS 3.2).

The client validates every batch completely, routes keys to shards by
``splitmix64(key) mod num_shards`` and makes exactly one call per shard per batch. Without a Dask
client the shards are plain objects in this process; with one, each shard is a Dask actor pinned to
a worker (round robin over the cluster's workers) and the calls to different shards are issued
together, then awaited, so shards work concurrently. On a plain-tcp cluster the batch calls
(lookup, update, apply_gradients, row_metadata) travel on the direct path of
:mod:`carlskit.bank._direct` (a ZeroMQ socket per shard beside its actor: 0.5 ms round trip to both
shards against 2.1 ms through Dask's actor RPC); everything else uses the actor. ``lookup_async``
and ``apply_gradients_async`` return a :class:`BankFuture` right after sending, so a caller can keep
several batches in flight.

Lazy gradient updates follow the CARLS rule documented in :mod:`carlskit.bank._lazy`: gradients
for a key are cached until (a) the key is looked up, (b) it has ``max_pending`` cached gradients,
or (c) its oldest cached gradient is older than ``pending_ttl_seconds`` (checked at the start of
every call that reaches the key's shard, and by :meth:`KnowledgeBank.flush`). Then: drop NaN/Inf
gradients; if >= 3 remain drop those with ``norm > median + outlier_threshold * 1.4826 * MAD``;
average the rest and take one ``sgd`` (v -= lr g) or ``adagrad`` (a += g^2; v -= lr g /
sqrt(a + eps)) step. An ``update`` of a key discards its cached gradients (they were computed
against the value being replaced; counted as ``discarded_by_update``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import math
import os
import threading
import time
import weakref
from typing import Any, Callable

import numpy as np

from carlskit._checks import choice, finite_float, int64, integer, positive_float
from carlskit._errors import WorkerLostError
from carlskit.bank._direct import DirectCall, DirectPath, DirectPathLost, DirectRequestLost
from carlskit.bank._hashing import key_from_string, shard_of
from carlskit.bank._nearest import METRICS, top_k
from carlskit.bank._shard import _Shard
from carlskit.bank._snapshot import (
    SNAPSHOT_FORMAT,
    SNAPSHOT_VERSION,
    Location,
    SnapshotSeries,
    check_save_target,
    new_save_id,
    read_manifest,
    run_parallel,
    write_manifest,
)
from carlskit.bank._wal import truncate_before
from carlskit.cluster._loss import actor_lost, is_worker_loss
from carlskit.cluster._placement import Placement

INITIALIZERS = ("zeros", "normal", "uniform")
OPTIMIZERS = ("sgd", "adagrad")
INDEXES = ("flat", "hnsw")
#: Sane upper bounds of size arguments (a clear ValueError instead of a MemoryError): rows are
#: int32 inside a shard; a table's row width (``dim``, a feature field's width) is at most 65536;
#: ``capacity`` is a preallocation hint of which at most PREALLOCATED_ROWS rows per shard are
#: allocated up front (tables grow geometrically beyond); ``nearest`` returns at most
#: MAX_NEAREST_RESULTS = nq * k results per shard (12 bytes each); ``sample`` draws at most
#: MAX_SAMPLE keys per call.
MAX_ROWS_PER_SHARD = 2**31 - 1
MAX_WIDTH = 1 << 16
PREALLOCATED_ROWS = 1 << 22
MAX_NEAREST_RESULTS = 1 << 27
MAX_SAMPLE = 1 << 26
#: Short batch methods run on the worker's event loop (``separate_thread=False``): this saves a
#: thread hand-off per call. Long ones (nearest, sample, stats, snapshots) keep Dask's actor thread.
_ON_EVENT_LOOP = frozenset({"lookup", "update", "apply_gradients", "row_metadata", "ping",
                            "table_configs"})


class ShardLostError(WorkerLostError):
    """A shard's actor (or its worker) is gone. ``bank.recover()`` rebuilds it alone from the
    latest snapshot (:meth:`KnowledgeBank.enable_snapshots`), or ``KnowledgeBank.load(snapshot)``
    restores the whole bank.

    A batch call that reaches several shards waits for all of them before raising, and says what
    happened: ``shard`` (the first lost one), ``lost_shards``, ``applied_shards`` (the shards that
    acknowledged the call: their part was applied), and for ``lookup``, ``update`` and
    ``apply_gradients`` (and ``row_metadata``) ``applied_keys`` / ``unapplied_keys`` (int64 arrays;
    None for other calls).
    A lost shard's part was not acknowledged: after ``recover()`` it is there only if the shard's
    write-ahead log recorded it before the worker died, so re-send ``unapplied_keys`` (an
    ``update`` is idempotent; a gradient may then count twice).
    """

    def __init__(self, message: str, shard: int | None = None) -> None:
        super().__init__(message)
        self._bank: Any = None  # weakref to the bank that raised it
        self.shard = shard
        self.lost_shards: list[int] = [] if shard is None else [shard]
        self.applied_shards: list[int] = []
        self.applied_keys: np.ndarray | None = None
        self.unapplied_keys: np.ndarray | None = None

    @property
    def bank(self) -> "KnowledgeBank | None":
        """The bank that raised this error (None once it is gone): its :meth:`~KnowledgeBank.recover`
        rebuilds the shard (what ``Trainer.fit`` does)."""
        return None if self._bank is None else self._bank()


class _Failed:
    """A shard call that could not even be sent (its error is raised when the batch is
    collected, after the other shards' calls were awaited)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def done(self) -> bool:
        return True


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
        if wrong is not None:
            raise TypeError(f"{name} must be all int64 ids or all strings, got "
                            f"{type(wrong).__name__} {wrong!r} among strings")
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


def _embedding_table_config(dim: int, initializer: str = "normal", seed: int = 0, *,
                            init_scale: float | None = None, optimizer: str = "sgd",
                            learning_rate: float = 0.1, initial_accumulator_value: float = 0.1,
                            epsilon: float = 1e-7, max_pending: int = 16,
                            pending_ttl_seconds: float = 60.0, outlier_threshold: float = 3.0,
                            index: str = "flat", index_metric: str = "dot", hnsw_m: int = 32,
                            hnsw_ef_search: int = 64) -> dict[str, Any]:
    """The checked configuration of an embedding table (``create_table`` and snapshot loading)."""
    dim = integer(dim, "dim", minimum=1, maximum=MAX_WIDTH)
    return {
        "kind": "embedding", "dim": dim,
        "initializer": choice(initializer, "initializer", INITIALIZERS),
        "seed": int64(seed, "seed"),
        "init_scale": (1.0 / math.sqrt(dim) if init_scale is None
                       else finite_float(init_scale, "init_scale", minimum=0.0)),
        "optimizer": choice(optimizer, "optimizer", OPTIMIZERS),
        "learning_rate": positive_float(learning_rate, "learning_rate"),
        "initial_accumulator_value": finite_float(initial_accumulator_value,
                                                   "initial_accumulator_value", minimum=0.0),
        "epsilon": positive_float(epsilon, "epsilon"),
        "max_pending": integer(max_pending, "max_pending", minimum=1),
        "pending_ttl_seconds": finite_float(pending_ttl_seconds, "pending_ttl_seconds",
                                            minimum=0.0, allow_infinity=True),
        "outlier_threshold": positive_float(outlier_threshold, "outlier_threshold"),
        "index": choice(index, "index", INDEXES),
        "index_metric": choice(index_metric, "index_metric", METRICS),
        "hnsw_m": integer(hnsw_m, "hnsw_m", minimum=2),
        "hnsw_ef_search": integer(hnsw_ef_search, "hnsw_ef_search", minimum=1),
    }


def _feature_table_config(schema: Any) -> dict[str, Any]:
    """The checked configuration of a feature table (``create_feature_table``, snapshot loading)."""
    if not isinstance(schema, dict) or not schema:
        raise ValueError("schema must be a non-empty dict {field: (dtype, width)}")
    clean = {}
    for field, spec in schema.items():
        if not isinstance(field, str) or not field:
            raise ValueError(f"schema field names must be non-empty str, got {field!r}")
        if not isinstance(spec, (tuple, list)) or len(spec) != 2:
            raise ValueError(f"schema[{field!r}] must be (dtype, width), got {spec!r}")
        try:
            if spec[0] is None:  # np.dtype(None) is float64
                raise TypeError("no dtype")
            dtype = np.dtype(spec[0])
        except TypeError as error:
            raise ValueError(f"schema[{field!r}] has an unknown dtype {spec[0]!r}") from error
        if dtype.kind not in "iufb":
            raise ValueError(f"schema[{field!r}] dtype must be numeric or bool, got {dtype}")
        clean[field] = [dtype.name, integer(spec[1], f"schema[{field!r}] width", minimum=1,
                                                   maximum=MAX_WIDTH)]
    return {"kind": "feature", "schema": clean}


def _config_to_json(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with infinite floats (e.g. ``pending_ttl_seconds=inf``) as the strings "inf" /
    "-inf": strict JSON has no Infinity."""
    return {key: (("inf" if value > 0 else "-inf") if isinstance(value, float) and math.isinf(value)
                  else value) for key, value in config.items()}


def _config_from_json(value: Any) -> Any:
    return float(value) if value in ("inf", "-inf") else value


def _checked_table_config(config: Any) -> dict[str, Any]:
    """A table config read from a snapshot manifest, checked like ``create_table``'s arguments."""
    if not isinstance(config, dict) or config.get("kind") not in ("embedding", "feature"):
        raise ValueError("kind must be 'embedding' or 'feature'")
    options = {k: _config_from_json(v) for k, v in config.items() if k != "kind"}
    return (_embedding_table_config(**options) if config["kind"] == "embedding"
            else _feature_table_config(**options))


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


def _merge_lookups(config: dict[str, Any], n: int, routes: list[tuple[int, np.ndarray | None]],
                   results: dict[int, Any]):
    """Per-shard lookup results back in the caller's key order."""
    if routes and routes[0][1] is None:
        return _owned(results[routes[0][0]])
    found = np.empty(n, dtype=bool)  # no routes (no keys, several shards): empty arrays
    if config["kind"] == "embedding":
        values = np.empty((n, config["dim"]), np.float32)
        for s, pos in routes:
            values[pos], found[pos] = results[s]
        return values, found
    values = {field: np.empty((n, width), np.dtype(dtype))
              for field, (dtype, width) in config["schema"].items()}
    for s, pos in routes:
        shard_values, found[pos] = results[s]
        for field in values:
            values[field][pos] = shard_values[field]
    return values, found


class BankFuture:
    """A bank call in flight (:meth:`KnowledgeBank.lookup_async`,
    :meth:`KnowledgeBank.apply_gradients_async`): one call per shard already sent.

    ``result()`` waits for every shard and returns what the blocking method returns (raising its
    errors, e.g. :class:`ShardLostError`); later calls return the same object. ``done()`` says
    whether every shard has answered, without waiting.
    """

    def __init__(self, bank: "KnowledgeBank", pending: dict[int, Any],
                 finish: Callable[[dict[int, Any]], Any],
                 sent: dict[int, np.ndarray] | None = None) -> None:
        self._bank = bank
        self._sent = sent
        self._pending: dict[int, Any] | None = pending
        self._finish = finish
        self._value: Any = None
        self._lock = threading.Lock()

    def done(self) -> bool:
        pending = self._pending
        if pending is None or not self._bank.distributed:
            return True
        return all(future.done() for future in pending.values())

    def result(self) -> Any:
        with self._lock:
            if self._pending is not None:
                self._value = self._finish(self._bank._collect(self._pending, self._sent))
                self._pending = None
            return self._value

    def __repr__(self) -> str:
        return f"<BankFuture: {'done' if self.done() else 'pending'}>"


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
        self._placement = Placement.of(workers, resources)
        if client is None and self._placement.restricted:
            raise ValueError("workers/resources place shards on a Dask cluster: pass a client too")
        self._client = client
        self._remote = client is not None
        self._clock = clock
        self._direct: DirectPath | None = None
        self._configs: dict[str, dict[str, Any]] = {}
        self._shard_futures: list[Any] = []
        self._shard_workers: list[str | None] = [None] * num_shards
        self._init_snapshots()
        if client is None:
            self._shards: list[Any] = [_Shard(i, num_shards, clock) for i in range(num_shards)]
        else:
            workers = self._placement.candidates(client)
            if not workers:
                raise ValueError(f"client has no workers to host the bank's shards (placement: {self._placement})")
            self._shard_workers = [workers[i % len(workers)] for i in range(num_shards)]
            self._shard_futures = [
                client.submit(_Shard, i, num_shards, clock, worker_process=True, actor=True,
                              workers=[worker], allow_other_workers=False, pure=False)
                for i, worker in enumerate(self._shard_workers)
            ]
            self._shards = [future.result() for future in self._shard_futures]
            if direct:
                self._direct = _open_direct_path(self._shards)

    # ------------------------------------------------------------------ shard calls
    @property
    def num_shards(self) -> int:
        return len(self._shards)

    @property
    def shard_workers(self) -> list[str | None]:
        """Address of the worker holding each shard (None for in-process shards)."""
        return list(self._shard_workers)

    @property
    def distributed(self) -> bool:
        return self._remote

    @property
    def transport(self) -> str:
        """How batch calls reach the shards: ``"in-process"``, ``"direct"`` (ZeroMQ sockets beside
        the Dask actors, :mod:`carlskit.bank._direct`) or ``"dask"`` (actor RPC only: the cluster
        does not speak plain tcp, or ``direct=False``)."""
        if not self._remote:
            return "in-process"
        return "direct" if self._direct is not None else "dask"

    def _lost(self, index: int, error: BaseException) -> ShardLostError:
        where = f" on worker {self._shard_workers[index]}" if self._shard_workers[index] else ""
        lost = ShardLostError(
            f"shard {index} of {self.num_shards}{where} is unreachable ({type(error).__name__}: "
            f"{error}); its rows are gone from this bank: bank.recover() rebuilds it alone from "
            f"the latest snapshot (see enable_snapshots), or KnowledgeBank.load(<snapshot>, "
            f"client) restores the whole bank", shard=index)
        lost.__cause__ = error
        lost._bank = weakref.ref(self)
        return lost

    def _actor_gone(self, index: int) -> bool:
        """Whether shard ``index``'s actor is known to be gone: the future that created it is no
        longer finished, or its worker left the cluster (state, never an error message)."""
        future = (self._shard_futures[index] if self._shard_futures
                  else getattr(self._shards[index], "_future", None))
        if actor_lost(future):
            return True
        if self._client is None or self._shard_workers[index] is None:
            return False
        try:
            workers = self._client.scheduler_info(n_workers=-1)["workers"]
        except Exception:  # noqa: BLE001 - no answer from the scheduler: nothing known
            return False
        return self._shard_workers[index] not in workers

    def _submit(self, method: str, calls: dict[int, tuple]) -> dict[int, Any]:
        """Issue one call per shard in ``calls`` ({shard: args}) without waiting. Distributed: the
        Dask actor futures ({shard: future}); in-process: the results, computed at once. A call
        that cannot be sent is kept as a failure and raised by :meth:`_collect` once the other
        shards' calls were awaited (so the error can say which shards applied theirs)."""
        self._require_open()
        if not self._remote:
            return {i: getattr(self._shards[i], method)(*args) for i, args in calls.items()}
        futures: dict[int, Any] = {}
        options = {"separate_thread": False} if method in _ON_EVENT_LOOP else {}
        direct = self._direct
        for i, args in calls.items():
            try:
                call = None
                if direct is not None and direct.serves(i, method):
                    alive = functools.partial(_direct_server_answers, self._shards[i],
                                              direct.addresses[i]["token"])
                    call = direct.call(i, method, args, alive)  # None: unreachable from here
                futures[i] = call if call is not None else getattr(self._shards[i], method)(
                    *args, **options)
            except Exception as error:  # noqa: BLE001 - classified by type and actor state
                lost = (isinstance(error, DirectPathLost) or is_worker_loss(error)
                        or self._actor_gone(i))
                futures[i] = _Failed(self._lost(i, error) if lost else error)
        return futures

    def _result(self, i: int, future: Any) -> Any:
        """The result of one shard call; ShardLostError when its actor or worker is gone."""
        if isinstance(future, _Failed):
            raise future.error
        if isinstance(future, DirectCall):
            try:
                return future.result()
            except DirectRequestLost as error:  # the shard lives; only this call is in doubt
                raise ConnectionError(f"shard {i} of {self.num_shards}: {error}; the shard is still "
                                      f"serving, so the call can be retried (a write may already "
                                      f"have been applied)") from error
            except DirectPathLost as error:  # any other error is the shard's own: as is
                raise self._lost(i, error) from error
        try:
            return future.result()
        except Exception as error:
            if is_worker_loss(error) or self._actor_gone(i):
                raise self._lost(i, error) from error
            raise

    def _collect(self, pending: dict[int, Any],
                 keys_by_shard: dict[int, np.ndarray] | None = None) -> dict[int, Any]:
        """Wait for every call issued by :meth:`_submit`; {shard: result}. A failed shard raises
        its own error, or ShardLostError naming it (with what was applied where) when its actor or
        worker is gone. ``keys_by_shard``: the keys each shard was sent (for the error)."""
        if not self._remote:
            return pending
        results: dict[int, Any] = {}
        lost: list[ShardLostError] = []
        other: BaseException | None = None
        for i, future in pending.items():
            try:
                results[i] = self._result(i, future)
            except ShardLostError as error:
                lost.append(error)
            except Exception as error:  # noqa: BLE001 - raised below, after every shard answered
                other = other or error
        if lost:
            error = lost[0]
            error.lost_shards = [e.shard for e in lost]
            error.applied_shards = sorted(results)
            if keys_by_shard is not None:
                empty = np.empty(0, np.int64)
                error.applied_keys = np.concatenate(
                    [empty] + [keys_by_shard[i] for i in sorted(results)])
                error.unapplied_keys = np.concatenate(
                    [empty] + [keys for i, keys in sorted(keys_by_shard.items()) if i not in results])
            raise error
        if other is not None:
            raise other
        return results

    def _call(self, method: str, calls: dict[int, tuple]) -> dict[int, Any]:
        """One call per shard in ``calls`` ({shard: args}); distributed calls run concurrently."""
        return self._collect(self._submit(method, calls))

    def ping(self) -> float:
        """Seconds for one round trip to every shard at once (raises ShardLostError naming a
        shard that does not answer): the fixed cost each batched call pays."""
        start = time.perf_counter()
        self._call_all("ping")
        return time.perf_counter() - start

    def _call_all(self, method: str, *args: Any) -> list[Any]:
        results = self._call(method, {i: args for i in range(self.num_shards)})
        return [results[i] for i in range(self.num_shards)]

    def _route(self, keys: np.ndarray) -> list[tuple[int, np.ndarray | None]]:
        """[(shard, positions of its keys)]; positions None means every key (single shard)."""
        if self.num_shards == 1:
            return [(0, None)]
        shard = shard_of(keys, self.num_shards)
        if self.num_shards <= np.iinfo(np.uint16).max:
            shard = shard.astype(np.uint16)  # numpy sorts 16-bit ints by radix sort: O(n)
        order = np.argsort(shard, kind="stable")
        bounds = np.searchsorted(shard[order], np.arange(self.num_shards + 1))
        return [(s, order[bounds[s]:bounds[s + 1]]) for s in range(self.num_shards)
                if bounds[s + 1] > bounds[s]]

    def _require_open(self) -> None:
        if not self._shards:
            raise ValueError("this KnowledgeBank is closed; load() a snapshot or create a new one")

    def _config(self, table: Any) -> dict[str, Any]:
        self._require_open()
        if not isinstance(table, str):
            raise TypeError(f"table must be a table name (str), got {type(table).__name__}")
        if table not in self._configs:
            self._configs.update(self._call("table_configs", {0: ()})[0])  # created elsewhere?
        if table not in self._configs:
            raise ValueError(f"unknown table {table!r}; tables: {sorted(self._configs)}")
        return self._configs[table]

    def _embedding_config(self, table: str, operation: str) -> dict[str, Any]:
        config = self._config(table)
        if config["kind"] != "embedding":
            raise ValueError(f"{operation} needs an embedding table; {table!r} is a feature table")
        return config

    # ------------------------------------------------------------------ tables
    def _create(self, name: str, config: dict[str, Any], capacity: int = 1024) -> None:
        if not isinstance(name, str):
            raise TypeError(f"name must be a non-empty str, got {type(name).__name__}")
        if not name:
            raise ValueError("name must be a non-empty str, got ''")
        if name in self._configs or name in self._call("table_configs", {0: ()})[0]:
            raise ValueError(f"table {name!r} already exists")
        per_shard = min(max(16, -(-capacity // self.num_shards)), PREALLOCATED_ROWS)
        self._call_all("create_table", name, config, per_shard)
        self._configs[name] = config

    def create_table(self, name: str, dim: int, initializer: str = "normal", seed: int = 0, *,
                     init_scale: float | None = None, optimizer: str = "sgd",
                     learning_rate: float = 0.1, initial_accumulator_value: float = 0.1,
                     epsilon: float = 1e-7, max_pending: int = 16,
                     pending_ttl_seconds: float = 60.0, outlier_threshold: float = 3.0,
                     index: str = "flat", index_metric: str = "dot", hnsw_m: int = 32,
                     hnsw_ef_search: int = 64, capacity: int = 1024) -> None:
        """Create an embedding table of float32 rows of size ``dim``.

        Args:
          initializer: ``zeros`` | ``normal`` (N(0, init_scale^2)) | ``uniform``
            (U(-init_scale, init_scale)); ``init_scale`` defaults to 1/sqrt(dim). Deterministic in
            (seed, key).
          optimizer: ``sgd`` (v -= lr g) or ``adagrad`` (a += g^2; v -= lr g / sqrt(a + epsilon),
            a starting at ``initial_accumulator_value``), applied to averaged cached gradients.
          max_pending, pending_ttl_seconds, outlier_threshold: the lazy update rule (module doc).
          index: ``flat`` (exact only) or ``hnsw`` (approximate search for ``index_metric``,
            kept current incrementally; exact search stays available with ``exact=True``).
          capacity: expected rows (preallocation hint only).
        """
        config = _embedding_table_config(
            dim, initializer, seed, init_scale=init_scale, optimizer=optimizer,
            learning_rate=learning_rate, initial_accumulator_value=initial_accumulator_value,
            epsilon=epsilon, max_pending=max_pending, pending_ttl_seconds=pending_ttl_seconds,
            outlier_threshold=outlier_threshold, index=index, index_metric=index_metric,
            hnsw_m=hnsw_m, hnsw_ef_search=hnsw_ef_search)
        self._create(name, config, self._capacity(capacity))

    def create_feature_table(self, name: str, schema: dict[str, tuple[str, int]], *,
                             capacity: int = 1024) -> None:
        """Create a table of fixed-width records, e.g. ``{"ids": ("int64", 32), "weights":
        ("float32", 32)}``. Absent fields read as -1 (signed integers), the largest value (unsigned
        integers), 0 (floats) or False (bool)."""
        self._create(name, _feature_table_config(schema), self._capacity(capacity))

    def _capacity(self, capacity: Any) -> int:
        return integer(capacity, "capacity", minimum=1,
                       maximum=MAX_ROWS_PER_SHARD * self.num_shards,
                       why=f" ({MAX_ROWS_PER_SHARD} rows per shard: rows are int32)")

    @property
    def tables(self) -> dict[str, dict[str, Any]]:
        """Configuration of every table (a deep copy: editing it changes nothing in the bank)."""
        self._configs.update(self._call("table_configs", {0: ()})[0])
        return copy.deepcopy(self._configs)

    # ------------------------------------------------------------------ data path
    def lookup(self, table: str, keys: Any, insert_missing: bool = False):
        """Values of ``keys``: (float32 [n, dim], found bool [n]) for embedding tables,
        ({field: [n, width]}, found) for feature tables. Flushes the keys' cached gradients first.
        Absent keys read as zeros (fill values) unless ``insert_missing`` inserts them with their
        initial value; ``found`` says whether each key existed before the call."""
        pending, finish, sent = self._send_lookup(table, keys, insert_missing, detach=False)
        return finish(self._collect(pending, sent))

    def lookup_async(self, table: str, keys: Any, insert_missing: bool = False) -> "BankFuture":
        """:meth:`lookup` without waiting: the shard calls are sent now and ``.result()`` returns
        what :meth:`lookup` returns. Keeping a few batches in flight hides the Dask round trip
        (one call per shard per batch); bad input raises here, before anything is sent. The keys
        are copied, so the caller may reuse its buffer at once. Calls in flight together may reach
        a shard in any order; a lookup sees every write whose ``result()`` returned before it was
        issued. In-process banks compute at once."""
        pending, finish, sent = self._send_lookup(table, keys, insert_missing, detach=True)
        return BankFuture(self, pending, finish, sent)

    def _send_lookup(self, table: str, keys: Any, insert_missing: bool,
                     detach: bool) -> tuple[dict[int, Any], Callable[[dict[int, Any]], Any], dict]:
        """Validate, route and send a lookup: (pending shard calls, merge of their results, the
        keys sent to each shard)."""
        config = self._config(table)
        keys = _as_keys(keys)
        if not isinstance(insert_missing, (bool, np.bool_)):
            raise TypeError(f"insert_missing must be a bool, got {type(insert_missing).__name__}")
        routes = self._route(keys)
        whole = _detached(keys, detach and self._remote)
        sent = {s: whole if pos is None else keys[pos] for s, pos in routes}
        pending = self._submit("lookup", {s: (table, sent[s], bool(insert_missing))
                                          for s, _ in routes})
        return pending, lambda results: _merge_lookups(config, len(keys), routes, results), sent

    def update(self, table: str, keys: Any, values: Any, version: int = 0) -> None:
        """Write ``values`` ([n, dim] float, or {field: [n, width]}) for ``keys`` with the model
        ``version`` that computed them. Later duplicates win; cached gradients of the keys are
        discarded. NaN/Inf values are rejected (ValueError) and nothing is written."""
        config = self._config(table)
        keys = _as_keys(keys)
        version = integer(version, "version", minimum=0)  # -1 marks "never updated"
        if config["kind"] == "embedding":
            values = _as_matrix(values, len(keys), config["dim"], "values")
            pick = lambda v, pos: v[pos]  # noqa: E731
        else:
            if not isinstance(values, dict) or set(values) != set(config["schema"]):
                raise ValueError(f"values must be a dict with fields {sorted(config['schema'])}")
            values = {field: _as_matrix(values[field], len(keys), width, f"values[{field!r}]",
                                        dtype=np.dtype(dtype))
                      for field, (dtype, width) in config["schema"].items()}
            pick = lambda v, pos: {f: a[pos] for f, a in v.items()}  # noqa: E731
        routes = self._route(keys)
        sent = {s: keys if pos is None else keys[pos] for s, pos in routes}
        self._collect(self._submit("update", {
            s: (table, keys, values, version) if pos is None else
            (table, sent[s], pick(values, pos), version) for s, pos in routes}), sent)

    def apply_gradients(self, table: str, keys: Any, gradients: Any) -> None:
        """Cache gradients ([n, dim]) for ``keys``; they are applied lazily (module docstring):
        averaged with NaN/Inf and outlier gradients dropped, then one optimizer step per key.
        Keys not yet present are inserted with their initial value."""
        self._collect(*self._send_gradients(table, keys, gradients, detach=False))

    def apply_gradients_async(self, table: str, keys: Any, gradients: Any) -> "BankFuture":
        """:meth:`apply_gradients` without waiting; ``.result()`` (None) waits for the shards and
        raises their errors. Inputs are validated and copied before anything is sent; ordering
        as in :meth:`lookup_async`."""
        pending, sent = self._send_gradients(table, keys, gradients, detach=True)
        return BankFuture(self, pending, lambda results: None, sent)

    def _send_gradients(self, table: str, keys: Any, gradients: Any,
                        detach: bool) -> tuple[dict[int, Any], dict[int, np.ndarray]]:
        """Validate, route and send gradients; the pending shard calls and the keys each got."""
        config = self._embedding_config(table, "apply_gradients")
        keys = _as_keys(keys)
        gradients = _as_matrix(gradients, len(keys), config["dim"], "gradients", finite=False)
        routes = self._route(keys)
        detach = detach and self._remote
        sent = {s: _detached(keys, detach) if pos is None else keys[pos] for s, pos in routes}
        return self._submit("apply_gradients", {
            s: (table, sent[s], _detached(gradients, detach)) if pos is None else
            (table, sent[s], gradients[pos]) for s, pos in routes}), sent

    def flush(self, table: str | None = None) -> None:
        """Apply every cached gradient now (of one table, or of all)."""
        if table is not None:
            self._embedding_config(table, "flush")
        self._call_all("flush", table)

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
        queries = _to_array(queries, "queries", f"[nq, {config['dim']}]")
        if queries.ndim != 2:
            raise ValueError(f"queries must have shape [nq, {config['dim']}], got {queries.shape}")
        queries = _as_matrix(queries, queries.shape[0], config["dim"], "queries")
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
        results = self._call_all("nearest", table, queries, k, metric, exclude, exact)
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
        results = self._call_all("sample", table, n, seed)
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
        routes = self._route(keys) or [(0, None)]  # no keys: ask one shard for empty columns
        sent = {s: keys if pos is None else keys[pos] for s, pos in routes}
        results = self._collect(self._submit("row_metadata", {s: (table, sent[s]) for s in sent}),
                                sent)
        if routes[0][1] is None:
            return _owned(results[0])
        out = {name: np.empty(len(keys), dtype=array.dtype)
               for name, array in results[routes[0][0]].items()}
        for s, pos in routes:
            for name, array in results[s].items():
                out[name][pos] = array
        return out

    def stats(self) -> dict[str, Any]:
        """Per table, summed over shards: rows (and ``rows_per_shard``), ``pending_gradients``,
        ``pending_keys``, ``min_version``/``max_version``, ``*_shard_calls`` (a batch that touches
        two shards counts two), rows looked up / inserted / updated, gradients received / applied,
        ``dropped_nonfinite``, ``dropped_outliers``, ``discarded_by_update``, ``optimizer_steps``,
        ``resident_bytes``."""
        per_shard = self._call_all("stats")
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
        snapshots = None if self._snapshotter is None else self._snapshotter.status()
        return {"shards": self.num_shards, "transport": self.transport, "tables": tables,
                "shard_workers": [{"shard": i, "worker": worker} for i, worker in enumerate(self._shard_workers)],
                "placement": str(self._placement), "snapshots": snapshots}

    # ------------------------------------------------------------------ snapshots
    def _init_snapshots(self) -> None:
        self._series: SnapshotSeries | None = None
        self._wal_directory: str | None = None
        self._snapshot_lock = threading.RLock()
        self._snapshotter: Any = None
        self._snapshotter_stop: Any = None
        self._published: str | None = None

    def _call_parallel(self, method: str, calls: dict[int, tuple]) -> dict[int, Any]:
        """Like :meth:`_call`, with in-process shards in threads (snapshot parts in parallel)."""
        if self._remote:
            return self._call(method, calls)
        self._require_open()
        items = list(calls.items())
        results = run_parallel([functools.partial(getattr(self._shards[i], method), *args)
                                for i, args in items])
        return {i: result for (i, _), result in zip(items, results)}

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
        self._require_open()
        self._save(Location(path))

    def _save(self, location: Location, wal_directory: str | None = None) -> dict[str, Any]:
        check_save_target(location)
        configs = sorted(self.tables.items())
        names = [name for name, _ in configs]
        save_id = new_save_id()
        written = self._call_parallel("write_snapshot_parts", {
            i: (location.url, save_id, names, wal_directory) for i in range(self.num_shards)})
        tables = []
        for name, config in configs:
            parts = [written[i]["parts"][name] for i in range(self.num_shards)]
            counters: dict[str, int] = {}
            for part in parts:
                for key, value in part["counters"].items():
                    counters[key] = counters.get(key, 0) + int(value)
            tables.append({"name": name, "config": _config_to_json(config),
                           "rows": sum(part["rows"] for part in parts), "counters": counters,
                           "parts": parts})
        manifest = {"format": SNAPSHOT_FORMAT, "version": SNAPSHOT_VERSION, "saved_at": time.time(),
                    "num_shards": self.num_shards, "save_id": save_id, "tables": tables,
                    "write_ahead_log": (None if wal_directory is None else
                                        [written[i]["wal_segment"] for i in range(self.num_shards)])}
        write_manifest(location, manifest)  # the commit point
        return manifest

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
            bank._call_parallel("import_snapshot", {
                s: (location.url, _import_plan(manifest, s, bank.num_shards))
                for s in range(bank.num_shards)})
        except BaseException:
            bank.close()  # release the shards (Dask actors) of the half-built bank
            raise
        return bank

    def enable_snapshots(self, directory: str | os.PathLike, *, every_seconds: float | None = None,
                         every_versions: int | None = None, keep: int = 3,
                         write_ahead_log: bool = False, poll_seconds: float = 1.0) -> str:
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
        """
        self._require_open()
        keep = integer(keep, "keep", minimum=1)
        if every_seconds is not None:
            every_seconds = positive_float(every_seconds, "every_seconds")
        if every_versions is not None:
            every_versions = integer(every_versions, "every_versions", minimum=1)
        poll_seconds = positive_float(poll_seconds, "poll_seconds")
        if not isinstance(write_ahead_log, bool):
            raise TypeError(f"write_ahead_log must be a bool, got {type(write_ahead_log).__name__}")
        series = SnapshotSeries(directory, keep)
        if write_ahead_log and not series.location.local:
            raise ValueError(f"write_ahead_log needs a local or mounted shared directory (the "
                             f"shards append to files there), got {series.location.url!r}")
        self._stop_snapshotter()
        with self._snapshot_lock:
            if self._wal_directory is not None and not write_ahead_log:
                self._call_all("stop_write_ahead_log")
            self._series = series
            self._wal_directory = series.wal_directory if write_ahead_log else None
            path = self.snapshot()
        if every_seconds is not None or every_versions is not None:
            from carlskit.cluster._supervised import LongRunningTasks, ThreadStopFlag

            self._snapshotter_stop = ThreadStopFlag()
            self._snapshotter = LongRunningTasks(None, "carlskit-bank-snapshots",
                                                 piece="snapshotter")
            self._snapshotter.launch("snapshots", self._snapshot_loop, lambda: (
                self._snapshotter_stop, every_seconds, every_versions, poll_seconds))
        return path

    def snapshot(self) -> str:
        """Take a snapshot into the directory of :meth:`enable_snapshots` now; its path. Older
        ones beyond ``keep`` (and write-ahead log segments they no longer need) are removed."""
        if self._series is None:
            raise ValueError("snapshot() needs a snapshot directory: call enable_snapshots(directory)")
        with self._snapshot_lock:
            number, path = self._series.next_path()
            manifest = self._save(Location(path), self._wal_directory)
            if self._wal_directory is not None:
                for shard, segment in enumerate(manifest["write_ahead_log"]):
                    truncate_before(self._wal_directory, shard, segment)
            self._series.prune(number)
            return path

    def latest_snapshot(self) -> str | None:
        """The newest intact snapshot of :meth:`enable_snapshots`' directory (None if none)."""
        return None if self._series is None else self._series.latest()

    def _snapshot_loop(self, stop: Any, every_seconds: float | None, every_versions: int | None,
                       poll_seconds: float) -> None:
        last_time = time.monotonic()
        last_version = max(self._call_all("max_version"))
        while not stop.is_set():
            time.sleep(poll_seconds)
            due = every_seconds is not None and time.monotonic() - last_time >= every_seconds
            version = None
            if not due and every_versions is not None:
                version = max(self._call_all("max_version"))
                due = version >= last_version + every_versions
            if due and not stop.is_set():
                version = max(self._call_all("max_version")) if version is None else version
                self.snapshot()
                last_time, last_version = time.monotonic(), version

    def _stop_snapshotter(self) -> None:
        if self._snapshotter is not None:
            self._snapshotter.stop(self._snapshotter_stop, timeout=60)
            self._snapshotter = None

    @property
    def recoverable(self) -> bool:
        """Whether :meth:`recover` can rebuild a lost shard by itself: a distributed bank that
        created its shards and keeps snapshots (:meth:`enable_snapshots`)."""
        return self._remote and bool(self._shard_futures) and self._series is not None

    def lost_shards(self) -> list[int]:
        """Shards whose actor or worker is gone (each checked by its actor's state, then a ping)."""
        lost = []
        for i in range(self.num_shards):
            if self._actor_gone(i):
                lost.append(i)
                continue
            try:
                self._call("ping", {i: ()})
            except ShardLostError:
                lost.append(i)
        return lost

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
        self._require_open()
        if not self._remote:
            return {}
        if not self._shard_futures:
            raise ValueError("recover() needs the bank that created the shards (not one attached "
                             "to them or unpickled in a task)")
        lost = self.lost_shards()
        if not lost:
            return {}
        with self._snapshot_lock:
            wal_directory = None
            if snapshot is None:
                path = self.latest_snapshot()
                if path is None:
                    raise ValueError(f"shards {lost} are lost and there is no snapshot to rebuild "
                                     f"them from: call enable_snapshots(directory) before a loss "
                                     f"(or pass snapshot=<path>)")
                wal_directory = self._wal_directory
            else:
                path = os.fspath(snapshot)
            location = Location(path)
            manifest = read_manifest(location)
            if manifest["num_shards"] != self.num_shards:
                raise ValueError(f"snapshot {location.url!r} has {manifest['num_shards']} shards, "
                                 f"this bank {self.num_shards}: recover() rebuilds a shard from its "
                                 f"own part")
            if wal_directory is not None and manifest["write_ahead_log"] is None:
                wal_directory = None
            live = [i for i in range(self.num_shards) if i not in lost]
            if live:
                self._configs.update(self._call("table_configs", {live[0]: ()})[live[0]])
            report = {}
            for shard in lost:
                start = time.perf_counter()
                worker = self._pick_worker(lost)
                future = self._client.submit(
                    _Shard, shard, self.num_shards, self._clock, worker_process=True, actor=True,
                    workers=[worker], allow_other_workers=False, pure=False)
                actor = future.result()
                for name, config in self._configs.items():
                    actor.create_table(name, config, 1024).result()
                actor.import_snapshot(location.url, _import_plan(manifest, shard,
                                                                 self.num_shards)).result()
                replayed = 0
                if wal_directory is not None:
                    replayed = actor.replay_write_ahead_log(
                        wal_directory, manifest["write_ahead_log"][shard]).result()
                address = actor.open_direct_path().result() if self._direct is not None else None
                old = self._shard_futures[shard]
                self._shards[shard], self._shard_futures[shard] = actor, future
                self._shard_workers[shard] = worker
                if self._direct is not None:
                    addresses = list(self._direct.addresses)
                    addresses[shard] = address
                    self._direct = DirectPath(addresses)
                old.release()
                rows = {name: t["rows"] for name, t in actor.stats().result().items()}
                report[shard] = {"worker": worker, "snapshot": location.url, "rows": rows,
                                 "replayed_calls": replayed,
                                 "seconds": time.perf_counter() - start}
            if self._wal_directory is not None and wal_directory is None:
                # the rebuilt shard does not continue the log it was not replayed from: a fresh
                # snapshot is the base every shard's log starts from again
                self.snapshot()
            if self._published is not None:
                self.publish(self._published)
        return report

    def _pick_worker(self, lost: list[int]) -> str:
        """A live worker of the bank's placement for a rebuilt shard: the one holding the fewest live shards."""
        workers = self._placement.candidates(self._client)
        dead = {self._shard_workers[i] for i in lost}
        candidates = [w for w in workers if w not in dead]
        if not candidates:
            raise ShardLostError(f"no live worker to rebuild shards {lost} on (placement: {self._placement})")
        load = {w: sum(1 for i, sw in enumerate(self._shard_workers) if sw == w and i not in lost)
                for w in candidates}
        return min(candidates, key=lambda w: (load[w], w))

    # ------------------------------------------------------------------ sharing and lifetime
    def publish(self, name: str) -> None:
        """Make this (distributed) bank reachable by other processes: ``KnowledgeBank.attach``."""
        if not self._remote or not self._shard_futures:
            raise ValueError("publish needs the distributed bank (client=...) that created the "
                             "shards, or one attached to them")
        if self._client is None:
            from distributed import get_client

            self._client = get_client()
        self._published = name
        self._client.publish_dataset(**{name: {"shards": self._shard_futures,
                                               "workers": self._shard_workers,
                                               "direct": self._direct}}, override=True)

    @classmethod
    def attach(cls, client: Any, name: str) -> "KnowledgeBank":
        """The bank published under ``name`` by another process, through ``client``."""
        handle = client.get_dataset(name)
        futures = list(handle["shards"])
        bank = _bank_from_actors([future.result() for future in futures], handle["workers"], {},
                                 handle.get("direct"), client)
        bank._shard_futures = futures
        return bank

    def __reduce__(self):
        """A distributed bank pickles as handles to its actors (e.g. into a Dask task); the copy
        uses the Dask client of the process that unpickles it."""
        if not self._remote:
            raise TypeError("an in-process KnowledgeBank cannot be pickled; create it with a "
                            "Dask client to share it, or save() it and load() it elsewhere")
        return (_bank_from_actors, (self._shards, self._shard_workers, self._configs, self._direct))

    def close(self) -> None:
        """Release the shard actors (distributed) or drop the in-process shards. A shard's
        direct server stops with its actor, once no bank (or published dataset) holds it."""
        self._stop_snapshotter()
        if self._wal_directory is not None and self._shards:
            # Closing must release every shard even when one is lost (its log file stays as it
            # was, which recover() would replay) or the bank is already closed (ValueError).
            with contextlib.suppress(ShardLostError, ValueError):
                self._call_all("stop_write_ahead_log")
        owned = bool(self._shard_futures)
        self._direct = None
        for future in self._shard_futures:
            future.release()
        self._shard_futures = []
        self._shards = []
        if owned:
            # Finished Dask actor calls can leave the actor handles in reference cycles, which
            # keep the actors (and their servers) alive until the next cyclic collection.
            gc.collect()

    def __repr__(self) -> str:
        where = (f"{self.num_shards} Dask actors, {self.transport} data path" if self.distributed
                 else "in-process")
        return f"<KnowledgeBank: {self.num_shards} shards ({where}), tables={sorted(self._configs)}>"

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><td>{name}</td><td>{c['kind']}</td><td>"
                       f"{c.get('dim', len(c.get('schema', {})))}</td></tr>"
                       for name, c in sorted(self._configs.items()))
        return (f"<b>KnowledgeBank</b> {self.num_shards} shard(s), "
                f"{'distributed' if self.distributed else 'in-process'}"
                f"<table><tr><th>table</th><th>kind</th><th>dim / fields</th></tr>{rows}</table>")


def _import_plan(manifest: dict[str, Any], shard: int, num_shards: int) -> list:
    """What shard ``shard`` of ``num_shards`` reads from a snapshot: per table (name, parts,
    counters, same_layout). Same shard count: its own part and counters; another: every part
    (streamed, its rows kept), the summed counters on shard 0."""
    same = manifest["num_shards"] == num_shards
    plan = []
    for entry in manifest["tables"]:
        if same:
            part = entry["parts"][shard]
            plan.append((entry["name"], [part], part["counters"], True))
        else:
            counters: dict[str, int] | None = None
            if shard == 0:
                counters = {}
                for part in entry["parts"]:
                    for key, value in part["counters"].items():
                        counters[key] = counters.get(key, 0) + value
            plan.append((entry["name"], entry["parts"], counters, False))
    return plan


def _direct_server_answers(actor: Any, token: str, timeout: float = 30.0) -> None:
    """Raise unless the shard actor answers through Dask within ``timeout`` seconds that its
    direct server (with ``token``) is still running."""
    if not actor.direct_path_serving(token, separate_thread=False).result(timeout=timeout):
        raise DirectPathLost("the shard's direct server has stopped")


def _open_direct_path(actors: list[Any]) -> DirectPath | None:
    """Start every shard's direct server; None when no shard can serve one (not plain tcp)."""
    addresses = [future.result() for future in [actor.open_direct_path() for actor in actors]]
    return DirectPath(addresses) if any(addresses) else None


def _bank_from_actors(actors: list[Any], workers: list[str | None],
                      configs: dict[str, dict[str, Any]], direct: DirectPath | None = None,
                      client: Any = None) -> KnowledgeBank:
    """A client object for existing shard actors (attach, unpickling). Unpickling may happen on a
    worker's event loop, so the Dask client is looked up lazily (only ``publish`` needs it); the
    actors find their worker or client themselves."""
    bank = KnowledgeBank.__new__(KnowledgeBank)
    bank._init_snapshots()
    bank._clock = None
    bank._client = client
    bank._remote = True
    bank._configs = dict(configs)
    bank._direct = direct
    bank._shard_futures = []
    bank._shard_workers = list(workers)
    bank._shards = list(actors)
    bank._placement = Placement()
    return bank
