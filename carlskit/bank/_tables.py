"""In-process table storage of one shard: growable numpy columns, key map, pending gradients.

A table stores its rows densely (row r = r-th key inserted into this shard) in preallocated numpy
columns that grow geometrically; unused capacity is never touched, so it is not resident memory.
Every batch operation is a handful of vectorized numpy calls; there is no per-key Python loop.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from carlskit._errors import CorruptFileError
from carlskit.bank._config import EmbeddingTableConfig, FeatureTableConfig, TableConfig
from carlskit.bank._hashing import initial_values, shard_of
from carlskit.bank._hashmap import Int64RowMap
from carlskit.bank._lazy import adagrad_step, combine_gradients, sgd_step
from carlskit.bank._nearest import HNSWIndex, exact_search, top_k, worst_score
from carlskit.bank._snapshot import REROUTE_CHUNK_ROWS, expected_layout

_GROWTH = 1.5


def row_norms(values: np.ndarray) -> np.ndarray:
    """L2 norm of each row [n, dim] -> [n] float32 (no [n, dim] temporary, unlike ``np.linalg.norm``)."""
    return np.sqrt(np.einsum("ij,ij->i", values, values, dtype=np.float32))


def _grown(array: np.ndarray, used: int, capacity: int) -> np.ndarray:
    out = np.empty((capacity,) + array.shape[1:], dtype=array.dtype)
    out[:used] = array[:used]
    return out


def _fill_value(dtype: np.dtype) -> Any:
    """Value of an absent feature record field: -1 for signed integers, the largest value (all
    bits set, -1 wrapped) for unsigned ones, False for bool, 0 for floats."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return False
    if dtype.kind == "u":
        return np.iinfo(dtype).max
    return -1 if dtype.kind == "i" else 0


def new_counters() -> dict[str, int]:
    return {
        "lookup_shard_calls": 0, "update_shard_calls": 0, "apply_gradients_shard_calls": 0, "nearest_shard_calls": 0,
        "sample_shard_calls": 0, "rows_looked_up": 0, "rows_inserted": 0, "rows_updated": 0,
        "gradients_received": 0, "gradients_applied": 0, "optimizer_steps": 0,
        "dropped_nonfinite": 0, "dropped_outliers": 0, "discarded_by_update": 0,
        "keys_not_admitted": 0, "gradients_not_admitted": 0, "rows_evicted_idle": 0, "rows_evicted_capacity": 0,
        "repeated_pushes_skipped": 0,
    }


class RowStore:
    """Keys, per-row metadata (version, last write time, lookup count) and named data columns."""

    def __init__(self, config: TableConfig, capacity: int = 1024) -> None:
        self.config = config
        self.num_rows = 0
        self.max_version = -1  # of any update so far (automatic snapshots every N versions)
        self.capacity = capacity
        self.row_map = Int64RowMap(capacity)
        self.counters = new_counters()
        self.columns: dict[str, np.ndarray] = {}
        self.add_column("keys", (), np.int64)
        self.add_column("version", (), np.int64)
        self.add_column("last_write_time", (), np.float64)
        self.add_column("lookup_count", (), np.int64)

    def add_column(self, name: str, shape: tuple[int, ...], dtype: Any) -> None:
        self.columns[name] = np.empty((self.capacity,) + tuple(shape), dtype=dtype)

    def __getattr__(self, name: str) -> np.ndarray:  # columns read as attributes: self.values
        columns = self.__dict__.get("columns")
        if columns is not None and name in columns:
            return columns[name]
        raise AttributeError(name)

    @property
    def nbytes(self) -> int:
        """Bytes of the used rows of every column plus the key map."""
        per_row = sum(c.itemsize * int(np.prod(c.shape[1:])) for c in self.columns.values())
        return per_row * self.num_rows + self.row_map.nbytes

    def _reserve(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        self.capacity = max(needed, int(self.capacity * _GROWTH))
        for name, column in self.columns.items():
            self.columns[name] = _grown(column, self.num_rows, self.capacity)

    def rows_of(self, keys: np.ndarray, insert_missing: bool, now: float) -> tuple[np.ndarray, np.ndarray]:
        """Rows of ``keys`` (-1 where absent unless inserted) and whether each key existed before."""
        rows = self.row_map.get(keys)
        found = rows >= 0
        if insert_missing and not found.all():
            new_keys, inverse = np.unique(keys[~found], return_inverse=True)
            self._reserve(self.num_rows + len(new_keys))
            new_rows = self.row_map.insert_new(new_keys)
            self.num_rows += len(new_keys)
            self.columns["keys"][new_rows] = new_keys
            self.columns["version"][new_rows] = -1
            self.columns["last_write_time"][new_rows] = now
            self.columns["lookup_count"][new_rows] = 0
            self.initialize_rows(new_rows, new_keys)
            self.counters["rows_inserted"] += len(new_keys)
            rows[~found] = new_rows[inverse]
        return rows, found

    def initialize_rows(self, rows: np.ndarray, keys: np.ndarray) -> None:
        raise NotImplementedError

    def count_lookups(self, rows: np.ndarray) -> None:
        np.add.at(self.columns["lookup_count"], rows, 1)
        self.counters["lookup_shard_calls"] += 1
        self.counters["rows_looked_up"] += len(rows)

    def metadata(self, keys: np.ndarray) -> dict[str, np.ndarray]:
        rows = self.row_map.get(keys)
        found = rows >= 0
        safe = np.where(found, rows, 0)

        def column(name: str, missing: Any) -> np.ndarray:
            if self.num_rows == 0:
                return np.full(len(keys), missing, dtype=self.columns[name].dtype)
            return np.where(found, self.columns[name][safe], missing)

        return {"found": found, "version": column("version", -1),
                "last_write_time": column("last_write_time", np.nan),
                "lookup_count": column("lookup_count", 0)}

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        self.counters["sample_shard_calls"] += 1
        if self.num_rows == 0:
            return np.full(n, -1, dtype=np.int64)
        return self.columns["keys"][rng.integers(0, self.num_rows, n)]

    def dedupe_last(self, keys: np.ndarray) -> np.ndarray:
        """Positions of the last occurrence of each distinct key (later writes win)."""
        _, last_from_end = np.unique(keys[::-1], return_index=True)
        return len(keys) - 1 - last_from_end

    def base_stats(self) -> dict[str, Any]:
        version = self.columns["version"][: self.num_rows]
        written = version[version >= 0]
        return {"rows": self.num_rows, "resident_bytes": self.nbytes,
                "min_version": int(written.min()) if len(written) else None,
                "max_version": int(written.max()) if len(written) else None,
                "rows_with_version": int(len(written)), **self.counters}

    # ----- snapshots (format: carlskit.bank._snapshot)
    def snapshot_columns(self) -> tuple[list[tuple[str, np.ndarray]], dict[str, int]]:
        """The columns of this table's snapshot part, in file order, as views of the table's own
        arrays (no copy; pending gradients are gathered), and the part's rows / pending / buckets."""
        pending = self.pending_arrays()
        meta = {"rows": self.num_rows, "pending": len(pending.get("pending_keys", ())),
                "row_map_buckets": len(self.row_map.bucket_fill)}
        sources = {"row_map_keys": self.row_map.bucket_keys, "row_map_rows": self.row_map.bucket_rows,
                   "row_map_fill": self.row_map.bucket_fill, **pending}
        columns = []
        for name, _, _ in expected_layout(self.config, meta["rows"], meta["pending"],
                                          meta["row_map_buckets"]):
            columns.append((name, sources[name] if name in sources
                            else self.columns[name][: self.num_rows]))
        return columns, meta

    def pending_arrays(self) -> dict[str, np.ndarray]:
        return {}

    def restore_part(self, reader: Any) -> dict[str, np.ndarray]:
        """Read a part saved by the shard of the same index and shard count into this empty
        table: columns straight into the table's arrays, the hash map as saved (no rehashing).
        Returns the part's pending gradients (for :meth:`import_pending`)."""
        part, rows = reader.part, reader.part["rows"]
        if self.num_rows:
            raise ValueError("a snapshot part is restored into an empty table only")
        self._reserve(rows)
        extra = {}
        for name, _, _, _ in part["layout"]:
            if name in self.columns:
                reader.read_into(name, self.columns[name][:rows])
            else:  # pending gradients and the hash map's buckets
                extra[name] = reader.read_new(name)
        reader.finish()  # every byte against the manifest's SHA-256
        if int(extra["row_map_fill"].sum()) != rows:
            raise CorruptFileError(reader.where, f"its hash map holds {int(extra['row_map_fill'].sum())} "
                                                 f"keys for {rows} rows")
        self.row_map = Int64RowMap.restored(extra["row_map_keys"], extra["row_map_rows"],
                                            extra["row_map_fill"], rows)
        self.num_rows = rows
        self.restored_rows(0, rows)
        return {k: v for k, v in extra.items() if k.startswith("pending_")}

    def reroute_part(self, reader: Any, shard_index: int,
                     num_shards: int) -> dict[str, np.ndarray]:
        """Append the rows of a part that route to ``shard_index`` of ``num_shards``: the keys
        column is read whole, every other column in chunks of REROUTE_CHUNK_ROWS rows. Returns the
        part's pending gradients of those rows (:meth:`import_pending` takes all parts at once)."""
        keys = reader.read_new("keys")
        mine = shard_of(keys, num_shards) == shard_index
        chosen = keys[mine]
        start = self.num_rows
        self._reserve(start + len(chosen))
        extra: dict[str, np.ndarray] = {}
        pending_mine = None
        for name, _, _, _ in reader.part["layout"][1:]:
            if name in self.columns or name in ("pending_gradients", "pending_times"):
                selection = mine if name in self.columns else pending_mine
                dtype, shape = reader.columns[name]
                if name in self.columns:
                    out = self.columns[name][start:start + len(chosen)]
                else:
                    out = extra[name] = np.empty((int(selection.sum()),) + shape[1:], dtype)
                done = 0
                for first, chunk in reader.read_chunks(name, REROUTE_CHUNK_ROWS):
                    picked = chunk[selection[first:first + len(chunk)]]
                    out[done:done + len(picked)] = picked
                    done += len(picked)
            elif name == "pending_keys":
                pending_keys = reader.read_new(name)
                pending_mine = shard_of(pending_keys, num_shards) == shard_index
                extra[name] = pending_keys[pending_mine]
            else:
                reader.skip(name)  # the saved hash map: this shard builds its own
        reader.finish()
        self.columns["keys"][start:start + len(chosen)] = chosen
        self.row_map.insert_new(chosen)
        self.num_rows = start + len(chosen)
        self.restored_rows(start, self.num_rows)
        return extra

    def restored_rows(self, start: int, end: int) -> None:
        """Finish rows [start, end) read from a snapshot (per-kind state)."""
        if end > start:
            self.max_version = max(self.max_version, int(self.columns["version"][start:end].max()))

    def import_pending(self, parts: list[dict[str, np.ndarray]]) -> None:
        """Pending gradients read from snapshot parts (embedding tables only)."""


class PendingGradients:
    """Cached gradients of one embedding table: one entry per received gradient.

    Entries live in arrival order in growable arrays; the entries of a row form a linked list
    (``head[row]`` -> newest entry, ``next_entry`` -> older one), so all pending gradients of a batch
    of rows are collected in at most max-count vectorized rounds. Flushed entries are dead and are
    compacted away once they are the majority. Because arrival order is time order, the entries due
    for the ttl flush are always a prefix of the live ones (found by binary search).
    """

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.size = 0  # entries appended since the last compaction
        self.live = 0
        self.ttl_cursor = 0  # every entry before it is dead
        capacity = 1024
        self.gradients = np.empty((capacity, dim), np.float32)
        self.rows = np.empty(capacity, np.int64)
        self.times = np.empty(capacity, np.float64)
        self.next_entry = np.empty(capacity, np.int64)
        self.alive = np.zeros(capacity, bool)

    def append(self, rows: np.ndarray, gradients: np.ndarray, times: np.ndarray,
               head: np.ndarray, count: np.ndarray) -> None:
        n = len(rows)
        if n == 0:
            return
        self._make_room(n, head)
        entries = np.arange(self.size, self.size + n)
        last_time = self.times[self.size - 1] if self.size else -np.inf
        self.gradients[entries] = gradients
        self.rows[entries] = rows
        self.times[entries] = np.maximum.accumulate(np.maximum(times, last_time))
        self.alive[entries] = True
        order = np.argsort(rows, kind="stable")
        sorted_rows, sorted_entries = rows[order], entries[order]
        group_start = np.r_[True, sorted_rows[1:] != sorted_rows[:-1]]
        previous = np.empty(n, np.int64)
        previous[1:] = sorted_entries[:-1]
        previous[group_start] = head[sorted_rows[group_start]]
        self.next_entry[sorted_entries] = previous
        group_end = np.r_[group_start[1:], True]
        head[sorted_rows[group_end]] = sorted_entries[group_end]
        starts = np.flatnonzero(group_start)
        count[sorted_rows[starts]] += np.diff(np.r_[starts, n]).astype(count.dtype)
        self.size += n
        self.live += n

    def take(self, rows: np.ndarray, head: np.ndarray, count: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Remove and return (gradients [m, dim], group index into ``rows`` [m]) of distinct rows."""
        current, group = head[rows], np.arange(len(rows))
        keep = current >= 0
        current, group = current[keep], group[keep]
        entries, groups = [], []
        while len(current):
            entries.append(current)
            groups.append(group)
            following = self.next_entry[current]
            keep = following >= 0
            current, group = following[keep], group[keep]
        if not entries:
            return np.empty((0, self.dim), np.float32), np.empty(0, np.int64)
        entries_all = np.concatenate(entries)
        self.alive[entries_all] = False
        self.live -= len(entries_all)
        head[rows] = -1
        count[rows] = 0
        return self.gradients[entries_all], np.concatenate(groups)

    def due_rows(self, cutoff_time: float) -> np.ndarray:
        """Distinct rows holding an entry older than ``cutoff_time``."""
        end = int(np.searchsorted(self.times[: self.size], cutoff_time, side="left"))
        if end <= self.ttl_cursor:
            return np.empty(0, np.int64)
        window = slice(self.ttl_cursor, end)
        rows = np.unique(self.rows[window][self.alive[window]])
        self.ttl_cursor = end  # flushing these rows kills every entry of the window
        return rows

    def live_entries(self) -> np.ndarray:
        return np.flatnonzero(self.alive[: self.size])

    def _make_room(self, n: int, head: np.ndarray) -> None:
        capacity = len(self.rows)
        if self.size + n <= capacity:
            return
        if self.size - self.live >= self.size // 2:
            self._compact(head)
        if self.size + n > len(self.rows):
            capacity = max(self.size + n, int(capacity * 2))
            for name in ("gradients", "rows", "times", "next_entry"):
                setattr(self, name, _grown(getattr(self, name), self.size, capacity))
            alive = np.zeros(capacity, bool)
            alive[: self.size] = self.alive[: self.size]
            self.alive = alive

    def _compact(self, head: np.ndarray) -> None:
        keep = self.live_entries()
        new_position = np.full(self.size, -1, np.int64)
        new_position[keep] = np.arange(len(keep))
        following = self.next_entry[keep]
        self.next_entry[: len(keep)] = np.where(following >= 0, new_position[np.maximum(following, 0)], -1)
        for name in ("gradients", "rows", "times"):
            array = getattr(self, name)
            array[: len(keep)] = array[keep]
        self.alive[:] = False
        self.alive[: len(keep)] = True
        pending_rows = np.flatnonzero(head >= 0)
        head[pending_rows] = new_position[head[pending_rows]]
        self.size = len(keep)
        self.ttl_cursor = 0


class EmbeddingTable(RowStore):
    """Float32 [dim] rows with optimizer state, lazy gradients and nearest-neighbour search.

    Admission and eviction, as production embedding stores have them (TF Recommenders-Addons,
    Monolith):

    - ``min_count`` > 1: a ``lookup(insert_missing=True)`` creates a key's row only once the key has
      been looked up (with insertion) in ``min_count`` calls; until then it reads the initializer's
      value and gets no row, and gradients sent for it are dropped (``keys_not_admitted``,
      ``gradients_not_admitted``). The counts of keys not admitted yet live in this shard's memory
      (a hash map entry and a count per key ever seen; not in snapshots: a restored shard counts
      afresh). ``update`` writes a row whatever its count.
    - ``max_idle_seconds``: a row not accessed (looked up, written, sent a gradient) for that long is
      removed at the start of the next call reaching the shard (``rows_evicted_idle``);
      ``max_rows_per_shard``: beyond that many rows, the least recently accessed are removed down to
      90% of it (``rows_evicted_capacity``; the margin makes eviction rare rather than every call).
      An eviction first applies every cached gradient of the table, then compacts the columns and
      rebuilds the key map (O(rows), amortised by the margin). A removed key that comes back starts
      from the initializer again. Access times are not in snapshots: a restored row counts as
      accessed at its last write.
    """

    def __init__(self, config: EmbeddingTableConfig, capacity: int = 1024) -> None:
        super().__init__(config, capacity)
        dim = config.dim
        self.add_column("values", (dim,), np.float32)
        self.add_column("norms", (), np.float32)
        self.add_column("pending_head", (), np.int64)
        self.add_column("pending_count", (), np.int32)
        if config.optimizer == "adagrad":
            self.add_column("accumulator", (dim,), np.float32)
        if config.evicts:
            self.add_column("last_access_time", (), np.float64)
        self.oldest_access = -np.inf  # a lower bound of every row's access time (no scan needed above it)
        self.candidates = Int64RowMap(1024) if config.min_count > 1 else None
        self.candidate_counts = np.zeros(1024, np.int64)
        self.pending = PendingGradients(dim)
        self.approximate = (
            HNSWIndex(dim, config.index_metric, config.hnsw_m, config.hnsw_ef_search)
            if config.index == "hnsw" else None
        )

    # ----- storage
    def initialize_rows(self, rows: np.ndarray, keys: np.ndarray) -> None:
        c = self.config
        values = initial_values(keys, c.dim, c.initializer, c.seed, c.init_scale)
        self.columns["values"][rows] = values
        self.columns["norms"][rows] = row_norms(values)
        self.columns["pending_head"][rows] = -1
        self.columns["pending_count"][rows] = 0
        if "accumulator" in self.columns:
            self.columns["accumulator"][rows] = c.initial_accumulator_value

    def _write_values(self, rows: np.ndarray, values: np.ndarray, now: float) -> None:
        self.columns["values"][rows] = values
        self.columns["norms"][rows] = row_norms(values)
        self.columns["last_write_time"][rows] = now
        if self.approximate is not None:
            self.approximate.mark_dirty(rows)

    # ----- lazy gradients
    @property
    def _head(self) -> np.ndarray:  # views of the used rows: compaction scans only those
        return self.columns["pending_head"][: self.num_rows]

    @property
    def _count(self) -> np.ndarray:
        return self.columns["pending_count"][: self.num_rows]

    def maintain(self, now: float) -> bool:
        """Flush keys whose oldest cached gradient is older than ``pending_ttl_seconds``, then evict
        (class docstring); whether anything changed."""
        changed = False
        if self.pending.live:
            due = self.pending.due_rows(now - self.config.pending_ttl_seconds)
            if len(due):
                self.flush_rows(due, now)
                changed = True
        return self._evict(now) or changed

    # ----- admission and eviction
    def _touch(self, rows: np.ndarray, now: float) -> None:
        if "last_access_time" in self.columns and len(rows):
            self.columns["last_access_time"][rows] = now

    def _admitted(self, keys: np.ndarray) -> np.ndarray:
        """Count one more sighting of each distinct absent key; those reaching ``min_count``."""
        slots = self.candidates.get(keys)
        new = slots < 0
        if new.any():
            slots[new] = self.candidates.insert_new(keys[new])
            if len(self.candidates) > len(self.candidate_counts):
                self.candidate_counts = np.concatenate(
                    [self.candidate_counts, np.zeros(len(self.candidates) * 2 - len(self.candidate_counts), np.int64)])
        self.candidate_counts[slots] += 1
        return keys[self.candidate_counts[slots] >= self.config.min_count]

    def rows_of(self, keys: np.ndarray, insert_missing: bool, now: float) -> tuple[np.ndarray, np.ndarray]:
        if self.candidates is None or not insert_missing:
            return super().rows_of(keys, insert_missing, now)
        rows, found = super().rows_of(keys, False, now)
        if not found.all():
            admitted = self._admitted(np.unique(keys[~found]))
            if len(admitted):
                super().rows_of(admitted, True, now)
                rows = self.row_map.get(keys)
        return rows, found

    def _evict(self, now: float) -> bool:
        c = self.config
        n = self.num_rows
        if not c.evicts or n == 0:
            return False
        limit = now - c.max_idle_seconds
        over = c.max_rows_per_shard is not None and n > c.max_rows_per_shard
        if not over and not limit > self.oldest_access:
            return False
        access = self.columns["last_access_time"][:n]
        drop = access < limit
        idle = int(drop.sum())
        if over and n - idle > c.max_rows_per_shard:
            target = c.max_rows_per_shard - c.max_rows_per_shard // 10
            alive = np.flatnonzero(~drop)
            oldest = alive[np.argpartition(access[alive], len(alive) - target - 1)[: len(alive) - target]] \
                if target < len(alive) else alive[:0]
            drop[oldest] = True
        keep = np.flatnonzero(~drop)
        self.oldest_access = float(access[keep].min()) if len(keep) else -np.inf
        if len(keep) == n:
            return False
        self.flush_all(now)  # cached gradients name rows by index: apply them before rows move
        for column in self.columns.values():
            column[: len(keep)] = column[keep]
        self.num_rows = len(keep)
        self.row_map = Int64RowMap(self.capacity)
        self.row_map.insert_new(self.columns["keys"][: len(keep)].copy())
        self.counters["rows_evicted_idle"] += idle
        self.counters["rows_evicted_capacity"] += n - len(keep) - idle
        return True

    def flush_rows(self, rows: np.ndarray, now: float) -> None:
        """Apply the cached gradients of distinct ``rows`` with the lazy rule (mean or sum)."""
        gradients, groups = self.pending.take(rows, self._head, self._count)
        if len(groups) == 0:
            return
        combined = combine_gradients(gradients, groups, len(rows), self.config.outlier_threshold,
                                     self.config.combine)
        self.counters["dropped_nonfinite"] += combined.dropped_nonfinite
        self.counters["dropped_outliers"] += combined.dropped_outliers
        self.counters["gradients_applied"] += int(combined.count.sum())
        self.counters["optimizer_steps"] += len(combined.group_index)
        if len(combined.group_index) == 0:
            return
        target = rows[combined.group_index]
        c = self.config
        if c.optimizer == "sgd":
            new_values = sgd_step(self.values[target], combined.gradient, c.learning_rate)
        else:
            new_values, self.columns["accumulator"][target] = adagrad_step(
                self.values[target], self.accumulator[target], combined.gradient,
                c.learning_rate, c.epsilon)
        self._write_values(target, new_values, now)

    def flush_all(self, now: float) -> None:
        if self.pending.live:
            rows = np.unique(self.pending.rows[self.pending.live_entries()])
            self.flush_rows(rows, now)

    def _flush_pending_of(self, rows: np.ndarray, now: float) -> None:
        if self.pending.live and len(rows):
            waiting = rows[self.pending_count[rows] > 0]
            if len(waiting):
                self.flush_rows(self._distinct(waiting), now)

    def _distinct(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` without repeats, in one pass and no sort (``np.unique`` hashes or sorts: 1.8 ms of
        a 20 ms lookup + gradient cycle of 17k rows): each position is written into its row's
        pending head, one write per row wins and reads back its own position; the heads are restored."""
        head = self.columns["pending_head"]
        saved = head[rows]
        position = np.arange(len(rows), dtype=head.dtype)
        head[rows] = position
        distinct = rows[head[rows] == position]
        head[rows] = saved
        return distinct

    # ----- operations
    def lookup(self, keys: np.ndarray, insert_missing: bool, now: float):
        rows, found = self.rows_of(keys, insert_missing, now)
        present = rows >= 0
        all_present = bool(present.all())
        valid_rows = rows if all_present else rows[present]
        self._flush_pending_of(valid_rows, now)
        if self.num_rows == 0:
            values = np.zeros((len(keys), self.config.dim), np.float32)
        else:
            values = self.values.take(rows if all_present else np.where(present, rows, 0), axis=0)
            if not all_present:
                values[~present] = 0.0
        if insert_missing and not all_present:  # keys below min_count: the initializer's value, no row
            c = self.config
            values[~present] = initial_values(keys[~present], c.dim, c.initializer, c.seed, c.init_scale)
            self.counters["keys_not_admitted"] += int((~present).sum())
        self.count_lookups(valid_rows)
        self._touch(valid_rows, now)
        return values, found

    def update(self, keys: np.ndarray, values: np.ndarray, version: int, now: float) -> None:
        last = self.dedupe_last(keys)
        keys, values = keys[last], values[last]
        rows, _ = self.rows_of(keys, True, now)
        if self.pending.live:
            waiting = rows[self.pending_count[rows] > 0]
            if len(waiting):
                gradients, _ = self.pending.take(waiting, self._head, self._count)
                self.counters["discarded_by_update"] += len(gradients)
        self._write_values(rows, values, now)
        self._touch(rows, now)
        self.version[rows] = version
        self.max_version = max(self.max_version, version)
        self.counters["update_shard_calls"] += 1
        self.counters["rows_updated"] += len(rows)

    def apply_gradients(self, keys: np.ndarray, gradients: np.ndarray, now: float) -> None:
        if self.candidates is None:
            rows, _ = self.rows_of(keys, True, now)
        else:  # only admitted keys (those with a row) take gradients
            rows = self.row_map.get(keys)
            if not (rows >= 0).all():
                self.counters["gradients_not_admitted"] += int((rows < 0).sum())
                gradients, rows = gradients[rows >= 0], rows[rows >= 0]
        self._touch(rows, now)
        self.pending.append(rows, gradients, np.full(len(rows), now), self._head, self._count)
        self.counters["apply_gradients_shard_calls"] += 1
        self.counters["gradients_received"] += len(rows)
        full = rows[self.pending_count[rows] >= self.config.max_pending]
        if len(full):
            self.flush_rows(np.unique(full), now)

    def nearest(self, queries: np.ndarray, k: int, metric: str, exclude: np.ndarray | None,
                exact: bool | None):
        self.counters["nearest_shard_calls"] += 1
        extra = 0 if exclude is None else exclude.shape[1]
        vectors = self.values[: self.num_rows]
        norms = self.norms[: self.num_rows]
        use_graph = (self.approximate is not None and exact is not True
                     and metric == self.approximate.metric)
        if use_graph:
            rows, scores = self.approximate.search(queries, vectors, norms, k + extra)
        else:
            rows, scores = exact_search(queries, vectors, norms, k + extra, metric)
        keys = np.where(rows >= 0, self.keys[np.maximum(rows, 0)] if self.num_rows else -1, -1)
        if extra:
            excluded = (keys[:, :, None] == exclude[:, None, :]).any(axis=2) & (keys >= 0)
            keys = np.where(excluded, -1, keys)
            scores = np.where(excluded, worst_score(metric), scores).astype(np.float32)
            keys, scores = top_k(keys, scores, k, metric)
        return keys, scores

    def stats(self) -> dict[str, Any]:
        return {**self.base_stats(), "pending_gradients": self.pending.live,
                "pending_keys": int((self.pending_count[: self.num_rows] > 0).sum())}

    # ----- snapshots
    def pending_arrays(self) -> dict[str, np.ndarray]:
        live = self.pending.live_entries()  # arrival (= time) order
        return {"pending_keys": self.keys[self.pending.rows[live]],
                "pending_gradients": self.pending.gradients[live],
                "pending_times": self.pending.times[live]}

    def restored_rows(self, start: int, end: int) -> None:
        super().restored_rows(start, end)
        self.pending_head[start:end] = -1
        self.pending_count[start:end] = 0
        if "last_access_time" in self.columns:  # not saved: a restored row was accessed at its last write
            self.columns["last_access_time"][start:end] = self.columns["last_write_time"][start:end]
            self.oldest_access = -np.inf

    def import_pending(self, parts: list[dict[str, np.ndarray]]) -> None:
        """All parts' pending gradients at once, in time order (arrival order is time order)."""
        parts = [part for part in parts if "pending_keys" in part]
        if not parts:
            return
        keys, gradients, times = (np.concatenate([part[name] for part in parts]) for name in
                                  ("pending_keys", "pending_gradients", "pending_times"))
        if len(keys):
            order = np.argsort(times, kind="stable")
            rows = self.row_map.get(keys[order])
            if (rows < 0).any():
                raise ValueError("snapshot part: pending gradients of keys that have no row")
            self.pending.append(rows, gradients[order], times[order], self._head, self._count)


class FeatureTable(RowStore):
    """Fixed-width records: one column per schema field, e.g. neighbour ids and weights."""

    def __init__(self, config: FeatureTableConfig, capacity: int = 1024) -> None:
        super().__init__(config, capacity)
        for field, dtype, width in config.schema:
            self.add_column("field:" + field, (width,), np.dtype(dtype))

    def _fields(self):
        return [(name[len("field:"):], column) for name, column in self.columns.items()
                if name.startswith("field:")]

    def initialize_rows(self, rows: np.ndarray, keys: np.ndarray) -> None:
        for _, column in self._fields():
            column[rows] = _fill_value(column.dtype)

    def maintain(self, now: float) -> bool:
        """Feature tables cache no gradients: there is nothing to flush on a ttl."""
        return False

    def flush_all(self, now: float) -> None:
        """Feature tables cache no gradients: there is nothing to apply."""

    def lookup(self, keys: np.ndarray, insert_missing: bool, now: float):
        rows, found = self.rows_of(keys, insert_missing, now)
        present = rows >= 0
        safe = np.where(present, rows, 0)
        out = {}
        for field, column in self._fields():
            if self.num_rows == 0:
                values = np.full((len(keys),) + column.shape[1:], _fill_value(column.dtype), column.dtype)
            else:
                values = column.take(safe, axis=0)
                values[~present] = _fill_value(column.dtype)
            out[field] = values
        self.count_lookups(rows[present])
        return out, found

    def update(self, keys: np.ndarray, values: dict[str, np.ndarray], version: int, now: float) -> None:
        last = self.dedupe_last(keys)
        rows, _ = self.rows_of(keys[last], True, now)
        for field, column in self._fields():
            column[rows] = values[field][last]
        self.version[rows] = version
        self.max_version = max(self.max_version, version)
        self.last_write_time[rows] = now
        self.counters["update_shard_calls"] += 1
        self.counters["rows_updated"] += len(rows)

    def stats(self) -> dict[str, Any]:
        return {**self.base_stats(), "pending_gradients": 0, "pending_keys": 0}
