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

import copy
import functools
import gc
import json
import math
import os
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ._direct import DirectCall, DirectPath, DirectPathLost, DirectRequestLost
from ._hashing import key_from_string, shard_of
from ._nearest import METRICS, top_k
from ._shard import _Shard

INITIALIZERS = ("zeros", "normal", "uniform")
OPTIMIZERS = ("sgd", "adagrad")
INDEXES = ("flat", "hnsw")
SNAPSHOT_FORMAT = "carlskit.KnowledgeBank"
SNAPSHOT_VERSION = 1
#: Short batch methods run on the worker's event loop (``separate_thread=False``): this saves a
#: thread hand-off per call. Long ones (nearest, sample, stats, snapshots) keep Dask's actor thread.
_ON_EVENT_LOOP = frozenset({"lookup", "update", "apply_gradients", "row_metadata", "ping",
                            "table_configs"})


class ShardLostError(RuntimeError):
    """A shard's actor (or its worker) is gone; restore with ``KnowledgeBank.load(snapshot)``."""


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


def _as_int(value: Any, name: str, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if not -2**63 <= value < 2**63:
        raise ValueError(f"{name} must fit in int64, got {value}")
    return int(value)


def _as_float(value: Any, name: str, positive: bool = False, allow_inf: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if math.isnan(value) or (math.isinf(value) and not allow_inf):
        raise ValueError(f"{name} must be finite, got {value}")
    if positive and value <= 0 or value < 0:
        raise ValueError(f"{name} must be {'> 0' if positive else '>= 0'}, got {value}")
    return value


def _choice(value: Any, name: str, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
    return value


def _embedding_table_config(dim: int, initializer: str = "normal", seed: int = 0, *,
                            init_scale: float | None = None, optimizer: str = "sgd",
                            learning_rate: float = 0.1, initial_accumulator_value: float = 0.1,
                            epsilon: float = 1e-7, max_pending: int = 16,
                            pending_ttl_seconds: float = 60.0, outlier_threshold: float = 3.0,
                            index: str = "flat", index_metric: str = "dot", hnsw_m: int = 32,
                            hnsw_ef_search: int = 64) -> dict[str, Any]:
    """The checked configuration of an embedding table (``create_table`` and snapshot loading)."""
    dim = _as_int(dim, "dim", minimum=1)
    return {
        "kind": "embedding", "dim": dim,
        "initializer": _choice(initializer, "initializer", INITIALIZERS),
        "seed": _as_int(seed, "seed"),
        "init_scale": (1.0 / math.sqrt(dim) if init_scale is None
                       else _as_float(init_scale, "init_scale")),
        "optimizer": _choice(optimizer, "optimizer", OPTIMIZERS),
        "learning_rate": _as_float(learning_rate, "learning_rate", positive=True),
        "initial_accumulator_value": _as_float(initial_accumulator_value,
                                               "initial_accumulator_value"),
        "epsilon": _as_float(epsilon, "epsilon", positive=True),
        "max_pending": _as_int(max_pending, "max_pending", minimum=1),
        "pending_ttl_seconds": _as_float(pending_ttl_seconds, "pending_ttl_seconds",
                                         allow_inf=True),
        "outlier_threshold": _as_float(outlier_threshold, "outlier_threshold", positive=True),
        "index": _choice(index, "index", INDEXES),
        "index_metric": _choice(index_metric, "index_metric", METRICS),
        "hnsw_m": _as_int(hnsw_m, "hnsw_m", minimum=2),
        "hnsw_ef_search": _as_int(hnsw_ef_search, "hnsw_ef_search", minimum=1),
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
        clean[field] = [dtype.name, _as_int(spec[1], f"schema[{field!r}] width", minimum=1)]
    return {"kind": "feature", "schema": clean}


def _column_file_name(column: str) -> str:
    """npz member name of a column: feature field ``field:ids`` is stored as ``field__ids``."""
    return "field__" + column[len("field:"):] if column.startswith("field:") else column


def _column_from_file_name(name: str) -> str:
    return "field:" + name[len("field__"):] if name.startswith("field__") else name


def _is_snapshot(path: Path) -> bool:
    """Whether ``path`` is a directory holding a KnowledgeBank snapshot manifest."""
    try:
        with open(path / "manifest.json") as handle:
            manifest = json.load(handle)
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == SNAPSHOT_FORMAT


def _config_to_json(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with infinite floats (e.g. ``pending_ttl_seconds=inf``) as the strings "inf" /
    "-inf": strict JSON has no Infinity."""
    return {key: (("inf" if value > 0 else "-inf") if isinstance(value, float) and math.isinf(value)
                  else value) for key, value in config.items()}


def _config_from_json(value: Any) -> Any:
    return float(value) if value in ("inf", "-inf") else value


def _snapshot_columns(config: dict[str, Any]) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """Row columns of a table's snapshot file: {column: (dtype, shape of one row)}."""
    columns = {"keys": (np.dtype(np.int64), ()), "version": (np.dtype(np.int64), ()),
               "last_write_time": (np.dtype(np.float64), ()),
               "lookup_count": (np.dtype(np.int64), ())}
    if config["kind"] == "embedding":
        columns["values"] = (np.dtype(np.float32), (config["dim"],))
        columns["norms"] = (np.dtype(np.float32), ())
        if config["optimizer"] == "adagrad":
            columns["accumulator"] = (np.dtype(np.float32), (config["dim"],))
    else:
        for field, (dtype, width) in config["schema"].items():
            columns["field:" + field] = (np.dtype(dtype), (width,))
    return columns


def _read_snapshot_table(path: Path, entry: Any, number: int) -> tuple[str, dict, dict, dict]:
    """(name, checked config, arrays, counters) of manifest ``tables[number]``; ValueError
    naming the file and the problem when anything is missing, malformed or inconsistent."""
    where = f"snapshot {str(path)!r} table {number}"
    if not isinstance(entry, dict) or not {"name", "config", "file"} <= set(entry):
        raise ValueError(f"{where}: manifest entry must be a dict with name, config and file")
    name, file_name, config = entry["name"], entry["file"], entry["config"]
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: table name must be a non-empty str, got {name!r}")
    where = f"snapshot {str(path)!r} table {name!r}"
    if not isinstance(file_name, str) or Path(file_name).name != file_name:
        raise ValueError(f"{where}: file must be a plain file name, got {file_name!r}")
    try:
        if not isinstance(config, dict) or config.get("kind") not in ("embedding", "feature"):
            raise ValueError("kind must be 'embedding' or 'feature'")
        options = {k: _config_from_json(v) for k, v in config.items() if k != "kind"}
        config = (_embedding_table_config(**options) if config["kind"] == "embedding"
                  else _feature_table_config(**options))
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: bad table config ({error})") from error
    counters = entry.get("counters", {})
    if not isinstance(counters, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
            for k, v in counters.items()):
        raise ValueError(f"{where}: counters must be a dict of non-negative ints")
    try:
        with np.load(path / file_name, allow_pickle=False) as data:
            arrays = {_column_from_file_name(column): data[column] for column in data.files}
    except FileNotFoundError as error:
        raise ValueError(f"{where}: file {file_name!r} is missing") from error
    except Exception as error:  # zipfile.BadZipFile, EOFError, ValueError (object arrays), ...
        raise ValueError(f"{where}: file {file_name!r} is not a readable npz archive "
                         f"({type(error).__name__}: {error})") from error
    expected = _snapshot_columns(config)
    pending = {"pending_keys": (np.dtype(np.int64), ()),
               "pending_gradients": (np.dtype(np.float32), (config.get("dim", 0),)),
               "pending_times": (np.dtype(np.float64), ())}
    if config["kind"] == "embedding" and set(pending) & set(arrays):
        expected.update(pending)
    if set(arrays) != set(expected):
        raise ValueError(f"{where}: file {file_name!r} holds columns {sorted(arrays)}, "
                         f"expected {sorted(expected)}")
    rows = len(arrays["keys"]) if arrays["keys"].ndim == 1 else -1
    for column, (dtype, row_shape) in expected.items():
        length = len(arrays["pending_keys"]) if column.startswith("pending_") else rows
        array = arrays[column]
        if array.dtype != dtype or array.shape != (length,) + row_shape:
            raise ValueError(f"{where}: column {column!r} must be {dtype} of shape "
                             f"{[length, *row_shape]}, got {array.dtype} {list(array.shape)}")
    if "rows" in entry and entry["rows"] != rows:
        raise ValueError(f"{where}: manifest says {entry['rows']} rows, file holds {rows}")
    keys = arrays["keys"]
    if (keys == -1).any() or len(np.unique(keys)) != len(keys):
        raise ValueError(f"{where}: keys must be distinct and not -1")
    for column in ("values", "norms", "accumulator"):
        if column in arrays and not np.isfinite(arrays[column]).all():
            raise ValueError(f"{where}: column {column!r} contains NaN or Inf")
    if "pending_keys" in arrays and not np.isin(arrays["pending_keys"], keys).all():
        raise ValueError(f"{where}: pending_keys holds keys that have no row")
    return name, config, arrays, counters


def _read_snapshot(path: Path) -> tuple[int, list[tuple[str, dict, dict, dict]]]:
    """(saved shard count, [(name, config, arrays, counters)]) of a snapshot directory, every part
    checked before anything is built; ValueError naming the file and the problem otherwise."""
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise FileNotFoundError(f"no KnowledgeBank snapshot at {str(path)!r} "
                                f"(missing {manifest_path.name})")
    try:
        with open(manifest_path) as handle:
            manifest = json.load(handle)
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"snapshot manifest {str(manifest_path)!r} is not valid JSON "
                         f"({error})") from error
    if not isinstance(manifest, dict) or manifest.get("format") != SNAPSHOT_FORMAT:
        raise ValueError(f"path {str(path)!r} is not a KnowledgeBank snapshot (manifest format "
                         f"is not {SNAPSHOT_FORMAT!r})")
    if manifest.get("version") != SNAPSHOT_VERSION:
        raise ValueError(f"snapshot {str(path)!r} has format version {manifest.get('version')!r}; "
                         f"this carlskit reads version {SNAPSHOT_VERSION}")
    tables = manifest.get("tables")
    if not isinstance(tables, list):
        raise ValueError(f"snapshot {str(path)!r}: manifest 'tables' must be a list")
    try:
        num_shards = _as_int(manifest.get("num_shards"), "num_shards", minimum=1)
    except (TypeError, ValueError) as error:
        raise ValueError(f"snapshot {str(path)!r}: manifest {error}") from error
    read = [_read_snapshot_table(path, entry, number) for number, entry in enumerate(tables)]
    names = [name for name, *_ in read]
    if len(set(names)) != len(names):
        raise ValueError(f"snapshot {str(path)!r}: table names repeat: {names}")
    return num_shards, read


def _write_snapshot_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """Write into a fresh sibling directory, then rename it onto ``path`` (old one removed last).

    ``path`` must be absent, an empty directory or an earlier snapshot: anything else (a file, a
    directory of other files) is refused with ValueError before anything is written, since the
    rename would delete it."""
    path = Path(path)
    if path.exists() or path.is_symlink():
        if not path.is_dir() or (any(path.iterdir()) and not _is_snapshot(path)):
            raise ValueError(f"path {str(path)!r} exists and is not a KnowledgeBank snapshot "
                             f"(or an empty directory); refusing to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        write(tmp)
        for child in tmp.iterdir():
            with open(child, "rb") as handle:
                os.fsync(handle.fileno())
        if path.exists():
            old = path.parent / f".{path.name}.old-{uuid.uuid4().hex}"
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
                 finish: Callable[[dict[int, Any]], Any]) -> None:
        self._bank = bank
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
                self._value = self._finish(self._bank._collect(self._pending))
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
    """

    def __init__(self, client: Any = None, num_shards: int = 1, *,
                 clock: Callable[[], float] | None = None, direct: bool = True) -> None:
        num_shards = _as_int(num_shards, "num_shards", minimum=1)
        if not isinstance(direct, bool):
            raise TypeError(f"direct must be a bool, got {type(direct).__name__}")
        if clock is not None and not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds, "
                            f"got {type(clock).__name__}")
        self._client = client
        self._remote = client is not None
        self._direct: DirectPath | None = None
        self._configs: dict[str, dict[str, Any]] = {}
        self._shard_futures: list[Any] = []
        self._shard_workers: list[str | None] = [None] * num_shards
        if client is None:
            self._shards: list[Any] = [_Shard(i, num_shards, clock) for i in range(num_shards)]
        else:
            workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
            if not workers:
                raise ValueError("client has no workers to host the bank's shards")
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
        return ShardLostError(
            f"shard {index} of {self.num_shards}{where} is unreachable ({type(error).__name__}: "
            f"{error}); its rows are lost: restore the bank with KnowledgeBank.load(<last "
            f"snapshot>, client)")

    def _submit(self, method: str, calls: dict[int, tuple]) -> dict[int, Any]:
        """Issue one call per shard in ``calls`` ({shard: args}) without waiting. Distributed: the
        Dask actor futures ({shard: future}); in-process: the results, computed at once."""
        self._require_open()
        if not self._remote:
            return {i: getattr(self._shards[i], method)(*args) for i, args in calls.items()}
        futures = {}
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
            except (OSError, RuntimeError, KeyError) as error:
                raise self._lost(i, error) from error
        return futures

    def _collect(self, pending: dict[int, Any]) -> dict[int, Any]:
        """Wait for the calls issued by :meth:`_submit`; {shard: result}. A failed shard raises
        its own error, or ShardLostError naming it when its actor or worker is gone."""
        if not self._remote:
            return pending
        results = {}
        for i, future in pending.items():
            if isinstance(future, DirectCall):
                try:
                    results[i] = future.result()
                except DirectRequestLost as error:  # the shard lives; only this call is in doubt
                    raise ConnectionError(f"shard {i} of {self.num_shards}: {error}; the shard is still "
                                          f"serving, so the call can be retried (a write may already "
                                          f"have been applied)") from error
                except DirectPathLost as error:  # any other error is the shard's own: as is
                    raise self._lost(i, error) from error
                continue
            try:
                results[i] = future.result()
            except (ValueError, TypeError) as error:
                if "lost" in str(error).lower() or "worker" in str(error).lower():
                    raise self._lost(i, error) from error
                raise
            except (OSError, RuntimeError, KeyError) as error:
                raise self._lost(i, error) from error
            except Exception as error:  # CancelledError and friends from the comm layer
                if type(error).__module__.startswith(("distributed", "asyncio", "concurrent")):
                    raise self._lost(i, error) from error
                raise
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
        per_shard = max(16, -(-capacity // self.num_shards))
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
        self._create(name, config, _as_int(capacity, "capacity", minimum=1))

    def create_feature_table(self, name: str, schema: dict[str, tuple[str, int]], *,
                             capacity: int = 1024) -> None:
        """Create a table of fixed-width records, e.g. ``{"ids": ("int64", 32), "weights":
        ("float32", 32)}``. Absent fields read as -1 (signed integers), the largest value (unsigned
        integers), 0 (floats) or False (bool)."""
        self._create(name, _feature_table_config(schema), _as_int(capacity, "capacity", minimum=1))

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
        pending, finish = self._send_lookup(table, keys, insert_missing, detach=False)
        return finish(self._collect(pending))

    def lookup_async(self, table: str, keys: Any, insert_missing: bool = False) -> "BankFuture":
        """:meth:`lookup` without waiting: the shard calls are sent now and ``.result()`` returns
        what :meth:`lookup` returns. Keeping a few batches in flight hides the Dask round trip
        (one call per shard per batch); bad input raises here, before anything is sent. The keys
        are copied, so the caller may reuse its buffer at once. Calls in flight together may reach
        a shard in any order; a lookup sees every write whose ``result()`` returned before it was
        issued. In-process banks compute at once."""
        return BankFuture(self, *self._send_lookup(table, keys, insert_missing, detach=True))

    def _send_lookup(self, table: str, keys: Any, insert_missing: bool,
                     detach: bool) -> tuple[dict[int, Any], Callable[[dict[int, Any]], Any]]:
        """Validate, route and send a lookup: (pending shard calls, merge of their results)."""
        config = self._config(table)
        keys = _as_keys(keys)
        if not isinstance(insert_missing, (bool, np.bool_)):
            raise TypeError(f"insert_missing must be a bool, got {type(insert_missing).__name__}")
        routes = self._route(keys)
        whole = _detached(keys, detach and self._remote)
        pending = self._submit("lookup", {s: (table, whole if pos is None else keys[pos],
                                              bool(insert_missing)) for s, pos in routes})
        return pending, lambda results: _merge_lookups(config, len(keys), routes, results)

    def update(self, table: str, keys: Any, values: Any, version: int = 0) -> None:
        """Write ``values`` ([n, dim] float, or {field: [n, width]}) for ``keys`` with the model
        ``version`` that computed them. Later duplicates win; cached gradients of the keys are
        discarded. NaN/Inf values are rejected (ValueError) and nothing is written."""
        config = self._config(table)
        keys = _as_keys(keys)
        version = _as_int(version, "version")
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
        self._call("update", {s: (table, keys, values, version) if pos is None else
                              (table, keys[pos], pick(values, pos), version) for s, pos in routes})

    def apply_gradients(self, table: str, keys: Any, gradients: Any) -> None:
        """Cache gradients ([n, dim]) for ``keys``; they are applied lazily (module docstring):
        averaged with NaN/Inf and outlier gradients dropped, then one optimizer step per key.
        Keys not yet present are inserted with their initial value."""
        self._collect(self._send_gradients(table, keys, gradients, detach=False))

    def apply_gradients_async(self, table: str, keys: Any, gradients: Any) -> "BankFuture":
        """:meth:`apply_gradients` without waiting; ``.result()`` (None) waits for the shards and
        raises their errors. Inputs are validated and copied before anything is sent; ordering
        as in :meth:`lookup_async`."""
        pending = self._send_gradients(table, keys, gradients, detach=True)
        return BankFuture(self, pending, lambda results: None)

    def _send_gradients(self, table: str, keys: Any, gradients: Any,
                        detach: bool) -> dict[int, Any]:
        """Validate, route and send gradients; the pending shard calls."""
        config = self._embedding_config(table, "apply_gradients")
        keys = _as_keys(keys)
        gradients = _as_matrix(gradients, len(keys), config["dim"], "gradients", finite=False)
        routes = self._route(keys)
        detach = detach and self._remote
        return self._submit("apply_gradients", {
            s: (table, _detached(keys, detach), _detached(gradients, detach)) if pos is None else
            (table, keys[pos], gradients[pos]) for s, pos in routes})

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
        k = _as_int(k, "k", minimum=1)
        metric = _choice(metric, "metric", METRICS)
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
        n = _as_int(n, "n", minimum=0)
        seed = _as_int(seed, "seed", minimum=0)
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
        results = self._call("row_metadata", {s: (table, keys if pos is None else keys[pos])
                                              for s, pos in routes})
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
        shards, transport and one row per table (rows, pending gradients, version range)."""
        stats = self.stats()
        tables = [{"table": name, "rows": t["rows"], "rows_per_shard": t["rows_per_shard"],
                   "pending_gradients": t["pending_gradients"], "min_version": t["min_version"],
                   "max_version": t["max_version"]} for name, t in stats["tables"].items()]
        return {"shards": self.num_shards, "transport": self.transport, "tables": tables}

    # ------------------------------------------------------------------ snapshots
    def save(self, path: str | os.PathLike) -> None:
        """Write a snapshot directory: ``manifest.json`` plus one ``table_NNN.npz`` per table
        (values, versions, write times, lookup counts, optimizer state, pending gradients),
        no pickle; written to a temporary sibling then renamed onto ``path``. ``path`` must be
        absent, an empty directory or an earlier snapshot (anything else: ValueError, nothing
        written)."""
        exports = self._call_all("export_tables")
        configs = self.tables
        manifest: dict[str, Any] = {"format": SNAPSHOT_FORMAT, "version": SNAPSHOT_VERSION,
                                    "saved_at": time.time(), "num_shards": self.num_shards,
                                    "tables": []}

        def write(directory: Path) -> None:
            for number, (name, config) in enumerate(sorted(configs.items())):
                parts = [export[name]["arrays"] for export in exports]
                arrays = {column: np.concatenate([part[column] for part in parts])
                          for column in parts[0]}
                counters: dict[str, int] = {}
                for export in exports:
                    for key, value in export[name]["counters"].items():
                        counters[key] = counters.get(key, 0) + int(value)
                file_name = f"table_{number:03d}.npz"
                np.savez(directory / file_name,
                         **{_column_file_name(c): a for c, a in arrays.items()})
                manifest["tables"].append({"name": name, "config": _config_to_json(config), "file": file_name,
                                           "rows": int(len(arrays["keys"])), "counters": counters})
            with open(directory / "manifest.json", "w") as handle:
                json.dump(manifest, handle, indent=1, allow_nan=False)  # strict JSON

        _write_snapshot_atomically(Path(path), write)

    @classmethod
    def load(cls, path: str | os.PathLike, client: Any = None, num_shards: int | None = None, *,
             clock: Callable[[], float] | None = None) -> "KnowledgeBank":
        """Restore a snapshot into ``num_shards`` shards (default: as saved), in-process or on
        ``client``'s workers: values, versions, write times, lookup counts, optimizer state and
        pending gradients exactly as saved. The whole snapshot is checked first: a missing,
        truncated or inconsistent file raises ValueError naming it (FileNotFoundError when there
        is no manifest) and no bank is built."""
        saved_shards, tables = _read_snapshot(Path(path))
        if num_shards is not None:
            num_shards = _as_int(num_shards, "num_shards", minimum=1)
        bank = cls(client, saved_shards if num_shards is None else num_shards, clock=clock)
        try:
            for name, config, arrays, counters in tables:
                bank._create(name, config, max(1024, len(arrays["keys"])))
                routes = bank._route(arrays["keys"]) or [(0, None)]  # no rows: counters still go
                pending_routes = (dict(bank._route(arrays["pending_keys"]))
                                  if "pending_keys" in arrays else {})  # {shard: positions}
                payload = {}
                for s, pos in routes:
                    part = {c: a if pos is None else a[pos] for c, a in arrays.items()
                            if not c.startswith("pending_")}
                    if s in pending_routes:
                        where = pending_routes[s]
                        part.update({c: a if where is None else a[where] for c, a in arrays.items()
                                     if c.startswith("pending_")})
                    payload[s] = (name, part, counters if s == routes[0][0] else None)
                bank._call("import_table", payload)
        except BaseException:
            bank.close()  # release the shards (Dask actors) of the half-built bank
            raise
        return bank

    # ------------------------------------------------------------------ sharing and lifetime
    def publish(self, name: str) -> None:
        """Make this (distributed) bank reachable by other processes: ``KnowledgeBank.attach``."""
        if not self._remote or not self._shard_futures:
            raise ValueError("publish needs the distributed bank (client=...) that created the "
                             "shards, or one attached to them")
        if self._client is None:
            from distributed import get_client

            self._client = get_client()
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
    bank._client = client
    bank._remote = True
    bank._configs = dict(configs)
    bank._direct = direct
    bank._shard_futures = []
    bank._shard_workers = list(workers)
    bank._shards = list(actors)
    return bank
