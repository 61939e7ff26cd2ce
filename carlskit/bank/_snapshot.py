"""Bank snapshots that scale: every shard writes and reads its own part of each table.

Layout of a snapshot directory (a local or shared directory, or any fsspec URL such as
``memory://`` or ``s3://``; format version 2)::

    manifest.json                          checked JSON (carlskit._serialization), written LAST
    t000-s00000-<save id>.part             table 0 (tables sorted by name), shard 0
    t000-s00001-<save id>.part             table 0, shard 1 ...

A part is the raw bytes of the shard's columns one after the other (keys first, then per-row
metadata, values, optimizer state, pending gradients, and the shard's key -> row hash map), written
straight from the shard's arrays by the shard's own worker: no pickle, no compression, no per-row
Python, no copy into the client. The manifest lists for every part its file, rows, byte size,
SHA-256 and column layout (name, dtype, shape, offset), so any changed byte of a part or of the
manifest is a :class:`carlskit.CorruptFileError` naming the file.

Commit point: the client writes the manifest (atomically) only after every shard has written and
fsync'd its parts. Parts carry a fresh save id in their names, so a save that dies half-way (a
worker SIGKILLed mid-write) never touches the parts the previous manifest names: the previous
snapshot stays loadable, and a directory holding parts but no manifest is refused as an
interrupted save. Files no manifest names are removed after the next successful commit.

Consistency: each shard writes all its parts while holding its lock, so a shard's part is the
state between two of its calls (writes arriving meanwhile wait and go after it). Shards are not
stopped together: a snapshot holds, per shard, one moment; every write acknowledged before
``save()`` was called is in it, a write acknowledged after ``save()`` returned is not, and a write
concurrent with the save may be in one shard's part and not in another's.

Loading into the same number of shards, shard ``i`` reads part ``i`` straight into its columns and
hash map (no hashing of keys, no copy). Into another number of shards, every new shard streams
every part in chunks of :data:`REROUTE_CHUNK_ROWS` rows and keeps the rows routed to it: memory per
shard is the keys column of one part plus one chunk, and nothing passes through the client.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import io
import os
import re
import threading
import time
import uuid
from typing import Any, Callable, Iterator

import fsspec.implementations.local
import fsspec.implementations.memory
import numpy as np

from carlskit._checks import integer
from carlskit._checks import path as check_path
from carlskit._errors import CorruptFileError
from carlskit._serialization import atomic_write, dumps_checked_json, filesystem, loads_checked_json
from carlskit.bank._config import EmbeddingTableConfig, TableConfig
from carlskit.bank._hashmap import BUCKET
from carlskit.bank._wal import truncate_before

SNAPSHOT_FORMAT = "carlskit.KnowledgeBank"
SNAPSHOT_VERSION = 2
MANIFEST = "manifest.json"
#: bytes per read/write call; the SHA-256 of chunk i runs in a helper thread while chunk i+1 is
#: written (hashlib and file I/O release the GIL), so hashing costs little wall time
CHUNK_BYTES = 16 << 20
#: rows per chunk when parts are re-routed into another number of shards (bounded memory)
REROUTE_CHUNK_ROWS = 1 << 16
_PART_NAME = re.compile(r"^t(\d{3,})-s(\d{5,})-([0-9a-f]{16})\.part$")
_SNAPSHOT_DIR = re.compile(r"^snapshot-(\d{12})$")
ROW_MAP_COLUMNS = ("row_map_keys", "row_map_rows", "row_map_fill")


def new_save_id() -> str:
    return uuid.uuid4().hex[:16]


def part_file_name(save_id: str, table_number: int, shard: int) -> str:
    return f"t{table_number:03d}-s{shard:05d}-{save_id}.part"


class Location:
    """A snapshot directory: a local path (made absolute, so workers resolve it the same way) or
    an fsspec URL."""

    def __init__(self, path: str | os.PathLike, name: str = "path") -> None:
        path = os.fspath(check_path(path, name))
        self.fs, self.root = filesystem(path)
        self.local = isinstance(self.fs, fsspec.implementations.local.LocalFileSystem)
        self.url = os.path.abspath(self.root) if self.local else path
        if self.local:
            self.root = self.url

    def __repr__(self) -> str:
        return self.url

    def file(self, name: str) -> str:
        return f"{self.root}/{name}"

    def names(self) -> list[str]:
        """Names of the entries directly in the directory ([] when it does not exist)."""
        if not self.fs.exists(self.root):
            return []
        return sorted(entry.rstrip("/").rsplit("/", 1)[-1]
                      for entry in self.fs.ls(self.root, detail=False))

    def open_write(self, name: str):
        if self.local:
            return open(self.file(name), "wb")
        return self.fs.open(self.file(name), "wb")

    def open_read(self, name: str):
        if self.local:
            return open(self.file(name), "rb")
        if isinstance(self.fs, fsspec.implementations.memory.MemoryFileSystem):
            # memory:// hands every reader the same file object (one position for all threads)
            return io.BytesIO(self.fs.cat_file(self.file(name)))
        return self.fs.open(self.file(name), "rb")


# ----------------------------------------------------------------------------- byte streaming
def _byte_chunks(arrays: list[np.ndarray]) -> Iterator[memoryview]:
    for array in arrays:
        if array.size == 0:
            continue
        view = memoryview(np.ascontiguousarray(array)).cast("B")
        for start in range(0, len(view), CHUNK_BYTES):
            yield view[start:start + CHUNK_BYTES]


def _read_exactly(handle: Any, chunk: memoryview, name: str) -> None:
    done = 0
    while done < len(chunk):
        count = handle.readinto(chunk[done:])
        if not count:
            raise CorruptFileError(name, f"truncated: ended {len(chunk) - done} bytes early")
        done += count


class _Hasher:
    """SHA-256 of a byte stream, computed in one helper thread one chunk behind the I/O."""

    def __init__(self) -> None:
        self.digest = hashlib.sha256()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="carlskit-sha256")
        self._pending: concurrent.futures.Future | None = None

    def add(self, chunk: memoryview) -> None:
        self.wait()
        self._pending = self._pool.submit(self.digest.update, chunk)

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def hexdigest(self) -> str:
        self.wait()
        # every chunk is hashed (wait() returned): nothing to join. Joining the idle helper was seen
        # to hang inside a Dask worker's actor thread (CPython's thread-state lock never released)
        self._pool.shutdown(wait=False)
        return self.digest.hexdigest()


def write_part(location: Location, name: str, columns: list[tuple[str, np.ndarray]]) -> dict:
    """Write ``columns`` (in order) to part file ``name``; fsync'd on local disks. Returns the
    manifest entry: file, bytes, sha256 and the layout ``[[column, dtype, shape, offset]]``."""
    layout, offset = [], 0
    for column, array in columns:
        layout.append([column, array.dtype.str, list(array.shape), offset])
        offset += array.nbytes
    hasher = _Hasher()
    try:
        with location.open_write(name) as handle:
            for chunk in _byte_chunks([array for _, array in columns]):
                # hash chunk i in the helper thread while chunk i is written here
                hasher.add(chunk)
                handle.write(chunk)
            if location.local:
                handle.flush()
                os.fsync(handle.fileno())
        digest = hasher.hexdigest()
    finally:
        hasher.wait()
    return {"file": name, "bytes": offset, "sha256": digest, "layout": layout}


class PartReader:
    """Reads one part's columns in file order, checking its SHA-256 at :meth:`finish`."""

    def __init__(self, location: Location, part: dict) -> None:
        self.part = part
        self.where = location.file(part["file"])
        try:
            self.handle = location.open_read(part["file"])
        except FileNotFoundError as error:
            raise CorruptFileError(self.where, "part file is missing") from error
        self.hasher = _Hasher()
        self.columns = {column: (np.dtype(dtype), tuple(shape))
                        for column, dtype, shape, _ in part["layout"]}
        self.order = [column for column, *_ in part["layout"]]
        self.position = 0

    def read_into(self, column: str, out: np.ndarray) -> None:
        """Read the whole of ``column`` (the next one in the file) into ``out``."""
        if self.order[self.position] != column:
            raise AssertionError(f"read {column!r}, expected {self.order[self.position]!r}")
        self.position += 1
        for chunk in _byte_chunks([out]):
            _read_exactly(self.handle, chunk, self.where)
            self.hasher.add(chunk)

    def read_new(self, column: str) -> np.ndarray:
        dtype, shape = self.columns[column]
        out = np.empty(shape, dtype)
        self.read_into(column, out)
        return out

    def read_chunks(self, column: str, rows_per_chunk: int) -> Iterator[tuple[int, np.ndarray]]:
        """``column`` in chunks of rows: (first row, chunk), one reused buffer."""
        dtype, shape = self.columns[column]
        if self.order[self.position] != column:
            raise AssertionError(f"read {column!r}, expected {self.order[self.position]!r}")
        self.position += 1
        buffers = [np.empty((min(rows_per_chunk, shape[0]),) + shape[1:], dtype) for _ in range(2)]
        for number, start in enumerate(range(0, shape[0], rows_per_chunk)):
            buffer = buffers[number % 2][: min(rows_per_chunk, shape[0] - start)]
            view = memoryview(buffer).cast("B") if buffer.size else None
            if view is not None:
                _read_exactly(self.handle, view, self.where)
                self.hasher.add(view)  # the other buffer's hash has finished: add() waits for it
            yield start, buffer

    def skip(self, column: str) -> None:
        for _ in self.read_chunks(column, REROUTE_CHUNK_ROWS):
            pass

    def finish(self) -> None:
        """Raise :class:`CorruptFileError` unless every byte was read and matches the SHA-256."""
        try:
            extra = self.handle.read(1)
        finally:
            self.handle.close()
        digest = self.hasher.hexdigest()
        if extra:
            raise CorruptFileError(self.where, f"longer than the {self.part['bytes']} bytes its "
                                               f"manifest records")
        if digest != self.part["sha256"]:
            raise CorruptFileError(self.where, "SHA-256 differs from the one its manifest records")

    def close(self) -> None:
        self.hasher.wait()
        self.handle.close()


# ----------------------------------------------------------------------------- manifest
def expected_layout(config: TableConfig, rows: int, pending: int,
                    row_map_buckets: int) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    """The columns of a part of a table with ``config``, in file order: keys first (re-routing
    reads them before anything else), then metadata, data, pending gradients, the hash map."""
    columns = [("keys", np.dtype(np.int64), (rows,)), ("version", np.dtype(np.int64), (rows,)),
               ("last_write_time", np.dtype(np.float64), (rows,)),
               ("lookup_count", np.dtype(np.int64), (rows,))]
    if isinstance(config, EmbeddingTableConfig):
        dim = config.dim
        columns += [("values", np.dtype(np.float32), (rows, dim)),
                    ("norms", np.dtype(np.float32), (rows,))]
        if config.optimizer == "adagrad":
            columns.append(("accumulator", np.dtype(np.float32), (rows, dim)))
        columns += [("pending_keys", np.dtype(np.int64), (pending,)),
                    ("pending_gradients", np.dtype(np.float32), (pending, dim)),
                    ("pending_times", np.dtype(np.float64), (pending,))]
    else:
        for field, dtype, width in sorted(config.schema):  # as the manifest sorts them
            columns.append(("field:" + field, np.dtype(dtype), (rows, width)))
    columns += [("row_map_keys", np.dtype(np.int64), (row_map_buckets, BUCKET)),
                ("row_map_rows", np.dtype(np.int32), (row_map_buckets, BUCKET)),
                ("row_map_fill", np.dtype(np.int16), (row_map_buckets,))]
    return columns


def check_part(part: Any, config: TableConfig, shard: int, where: str) -> dict:
    """``part`` (a manifest entry) checked against the table's config; CorruptFileError naming
    ``where`` (the manifest) otherwise."""
    def bad(problem: str) -> CorruptFileError:
        return CorruptFileError(where, f"part of shard {shard}: {problem}")

    if not isinstance(part, dict) or not {"file", "bytes", "sha256", "layout", "rows", "pending",
                                          "row_map_buckets", "counters"} <= set(part):
        raise bad("must be a dict with file, bytes, sha256, layout, rows, pending, "
                  "row_map_buckets and counters")
    if not isinstance(part["file"], str) or not _PART_NAME.match(part["file"]):
        raise bad(f"file must be a part file name, got {part['file']!r}")
    if not isinstance(part["sha256"], str) or not re.fullmatch(r"[0-9a-f]{64}", part["sha256"]):
        raise bad("sha256 must be 64 hex digits")
    numbers = ("bytes", "rows", "pending", "row_map_buckets")
    if not all(isinstance(part[n], int) and not isinstance(part[n], bool) and part[n] >= 0
               for n in numbers):
        raise bad(f"{', '.join(numbers)} must be non-negative ints")
    buckets = part["row_map_buckets"]
    if buckets < 4 or buckets & (buckets - 1):
        raise bad(f"row_map_buckets must be a power of two >= 4, got {buckets}")
    counters = part["counters"]
    if not isinstance(counters, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
            for k, v in counters.items()):
        raise bad("counters must be a dict of non-negative ints")
    pushes = part.get("pushes", [])  # absent from snapshots written before push ids
    if not isinstance(pushes, list) or not all(
            isinstance(p, int) and not isinstance(p, bool) and 0 <= p < 2 ** 63 for p in pushes):
        raise bad("pushes must be a list of push ids (ints in [0, 2**63))")
    expected = expected_layout(config, part["rows"], part["pending"], buckets)
    layout = part["layout"]
    offset = 0
    if not isinstance(layout, list) or len(layout) != len(expected):
        raise bad(f"layout must list the columns {[c for c, *_ in expected]}")
    for entry, (column, dtype, shape) in zip(layout, expected):
        if not (isinstance(entry, list) and len(entry) == 4 and entry[0] == column
                and entry[1] == dtype.str and entry[2] == list(shape) and entry[3] == offset):
            raise bad(f"layout entry {entry!r} should be [{column!r}, {dtype.str!r}, "
                      f"{list(shape)}, {offset}]")
        offset += dtype.itemsize * int(np.prod(shape))
    if part["bytes"] != offset:
        raise bad(f"bytes is {part['bytes']}, the layout adds up to {offset}")
    return part


def read_manifest(location: Location) -> dict:
    """The checked manifest of the snapshot at ``location``. FileNotFoundError when there is no
    snapshot; CorruptFileError naming the file for an interrupted save, a damaged or inconsistent
    manifest, a missing part or one of the wrong size."""
    names = location.names()
    where = location.file(MANIFEST)
    if MANIFEST not in names:
        if any(_PART_NAME.match(name) for name in names):
            raise CorruptFileError(where, "incomplete snapshot: parts but no manifest (a save "
                                          "was interrupted before its commit point)")
        raise FileNotFoundError(f"no KnowledgeBank snapshot at {location.url!r} "
                                f"(missing {MANIFEST})")
    with location.open_read(MANIFEST) as handle:
        content = loads_checked_json(handle.read(), where)
    if not isinstance(content, dict) or content.get("format") != SNAPSHOT_FORMAT:
        raise CorruptFileError(where, f"not a KnowledgeBank snapshot manifest (format is not "
                                      f"{SNAPSHOT_FORMAT!r})")
    if content.get("version") != SNAPSHOT_VERSION:
        raise CorruptFileError(where, f"format version {content.get('version')!r}; this carlskit "
                                      f"reads version {SNAPSHOT_VERSION}")
    try:
        num_shards = integer(content.get("num_shards"), "num_shards", minimum=1)
    except (TypeError, ValueError) as error:
        raise CorruptFileError(where, f"manifest {error}") from error
    tables = content.get("tables")
    if not isinstance(tables, list):
        raise CorruptFileError(where, "'tables' must be a list")
    seen: set[str] = set()
    for number, entry in enumerate(tables):
        _check_table_entry(entry, number, num_shards, seen, location, names)
    wal = content.get("write_ahead_log")
    if wal is not None and not (isinstance(wal, list) and len(wal) == num_shards and all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in wal)):
        raise CorruptFileError(where, "write_ahead_log must be null or one segment per shard")
    return content


def _check_table_entry(entry: Any, number: int, num_shards: int, seen: set[str],
                       location: Location, names: list[str]) -> None:
    """Check table ``number`` of a manifest (its config becomes a :class:`TableConfig`) and its
    parts' files (present, of the recorded size); CorruptFileError naming the file otherwise."""
    where = location.file(MANIFEST)
    if not isinstance(entry, dict) or not {"name", "config", "parts"} <= set(entry):
        raise CorruptFileError(where, f"table {number} must be a dict with name, config, parts")
    name = entry["name"]
    if not isinstance(name, str) or not name or name in seen:
        raise CorruptFileError(where, f"table {number}: name must be a new non-empty str, "
                                      f"got {name!r} (names repeat?)")
    seen.add(name)
    try:
        entry["config"] = TableConfig.from_json(entry["config"])
    except (TypeError, ValueError) as error:
        raise CorruptFileError(where, f"table {name!r}: bad table config ({error})") from error
    parts = entry["parts"]
    if not isinstance(parts, list) or len(parts) != num_shards:
        raise CorruptFileError(where, f"table {name!r}: needs one part per shard ({num_shards})")
    for shard, part in enumerate(parts):
        check_part(part, entry["config"], shard, where)
        if not part["file"].startswith(f"t{number:03d}-s{shard:05d}-"):
            raise CorruptFileError(where, f"table {name!r} shard {shard}: file "
                                          f"{part['file']!r} is another table's or shard's")
        if part["file"] not in names:
            raise CorruptFileError(location.file(part["file"]), "part file is missing")
        size = location.fs.size(location.file(part["file"]))
        if size != part["bytes"]:
            raise CorruptFileError(location.file(part["file"]),
                                   f"{size} bytes, its manifest records {part['bytes']}")


def write_manifest(location: Location, content: dict) -> None:
    """The commit point: the manifest, atomically; then files no manifest names are removed."""
    atomic_write(location.fs, location.file(MANIFEST), dumps_checked_json(content))
    keep = {part["file"] for table in content["tables"] for part in table["parts"]}
    for name in location.names():
        if (_PART_NAME.match(name) and name not in keep) or name.startswith(".tmp-"):
            try:
                location.fs.rm(location.file(name))
            except FileNotFoundError:
                pass


def check_save_target(location: Location) -> None:
    """``location`` must be absent, an empty directory or a snapshot directory (holding only a
    manifest, parts and temporaries): anything else is refused before anything is written, since a
    commit removes the parts no manifest names."""
    if location.fs.exists(location.root) and not location.fs.isdir(location.root):
        raise ValueError(f"path {location.url!r} exists and is not a KnowledgeBank snapshot "
                         f"(or an empty directory); refusing to replace it")
    names = location.names()
    strangers = [n for n in names if n != MANIFEST and not _PART_NAME.match(n)
                 and not n.startswith(".tmp-")]
    if strangers or (names and MANIFEST not in names and not any(map(_PART_NAME.match, names))):
        raise ValueError(f"path {location.url!r} exists and is not a KnowledgeBank snapshot "
                         f"(or an empty directory; it holds {strangers[:3]}); refusing to "
                         f"replace it")
    location.fs.makedirs(location.root, exist_ok=True)


# ----------------------------------------------------------------------------- series
class SnapshotSeries:
    """Numbered snapshots ``snapshot-NNNNNNNNNNNN`` in one directory (automatic snapshots), the
    newest ``keep`` kept; the write-ahead log, if any, lives in its ``wal`` subdirectory."""

    def __init__(self, directory: str | os.PathLike, keep: int) -> None:
        self.location = Location(directory, "directory")
        self.keep = keep
        self.location.fs.makedirs(self.location.root, exist_ok=True)

    def numbers(self) -> list[int]:
        return sorted(int(m.group(1)) for n in self.location.names()
                      if (m := _SNAPSHOT_DIR.match(n)))

    def path(self, number: int) -> str:
        return self.location.file(f"snapshot-{number:012d}") if self.location.local else \
            f"{self.location.url.rstrip('/')}/snapshot-{number:012d}"

    def next_path(self) -> tuple[int, str]:
        numbers = self.numbers()
        number = numbers[-1] + 1 if numbers else 1
        return number, self.path(number)

    def latest(self, skipped: list | None = None) -> str | None:
        """The newest snapshot whose manifest is intact (older ones are tried when the newest is
        damaged or was interrupted; each skipped one is appended to ``skipped`` with its reason)."""
        for number in reversed(self.numbers()):
            path = self.path(number)
            try:
                read_manifest(Location(path))
            except (OSError, ValueError) as error:
                if skipped is not None:
                    skipped.append((path, f"{type(error).__name__}: {error}"))
                continue
            return path
        return None

    def prune(self, newest: int) -> None:
        """Remove snapshots older than the ``keep`` newest committed ones up to ``newest``."""
        numbers = [n for n in self.numbers() if n <= newest]
        for number in numbers[:-self.keep]:
            try:
                self.location.fs.rm(Location(self.path(number)).root, recursive=True)
            except FileNotFoundError:
                pass

    @property
    def wal_directory(self) -> str:
        return self.location.file("wal")


def run_parallel(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run ``calls`` in threads (in-process shards write and read their parts in parallel)."""
    if len(calls) == 1:
        return [calls[0]()]
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        return [future.result() for future in [pool.submit(call) for call in calls]]


# ----------------------------------------------------------------------------- a bank's snapshots
def save(shards: Any, configs: dict[str, TableConfig], location: Location,
         wal_directory: str | None = None, wal_durability: str = "process") -> dict:
    """Save the tables ``configs`` of ``shards`` (a bank's :class:`~carlskit.bank._transport.ShardSet`)
    to ``location``: every shard writes its parts, then the manifest is written (the commit
    point). With ``wal_directory``, every shard starts a new write-ahead log segment at its part.
    Returns the manifest."""
    check_save_target(location)
    names = sorted(configs)
    save_id = new_save_id()
    try:
        written = shards.call_parallel("write_snapshot_parts", {
            i: (location.url, save_id, names, wal_directory, wal_durability) for i in range(len(shards))})
    except BaseException:
        _remove_parts_of(location, save_id)  # the shards that did write: no stray part beside the old snapshot
        raise
    tables = []
    for name in names:
        parts = [written[i]["parts"][name] for i in range(len(shards))]
        tables.append({"name": name, "config": configs[name].to_json(),
                       "rows": sum(part["rows"] for part in parts),
                       "counters": _summed_counters(parts), "parts": parts})
    manifest = {"format": SNAPSHOT_FORMAT, "version": SNAPSHOT_VERSION, "saved_at": time.time(),
                "num_shards": len(shards), "save_id": save_id, "tables": tables,
                "write_ahead_log": (None if wal_directory is None else
                                    [written[i]["wal_segment"] for i in range(len(shards))])}
    write_manifest(location, manifest)  # the commit point
    return manifest


def _remove_parts_of(location: Location, save_id: str) -> None:
    """Remove the part files of the (failed) save ``save_id``; the snapshot that was there stays."""
    for name in location.names():
        if _PART_NAME.match(name) and name.endswith(f"-{save_id}.part"):
            try:
                location.fs.rm(location.file(name))
            except FileNotFoundError:
                pass


def _summed_counters(parts: list[dict]) -> dict[str, int]:
    counters: dict[str, int] = {}
    for part in parts:
        for key, value in part["counters"].items():
            counters[key] = counters.get(key, 0) + int(value)
    return counters


def import_plan(manifest: dict, shard: int, num_shards: int) -> list:
    """What shard ``shard`` of ``num_shards`` reads from a snapshot: per table (name, parts,
    counters, same_layout). Same shard count: its own part and counters; another: every part
    (streamed, its rows kept), the summed counters on shard 0."""
    if manifest["num_shards"] == num_shards:
        return [(entry["name"], [entry["parts"][shard]], entry["parts"][shard]["counters"], True)
                for entry in manifest["tables"]]
    return [(entry["name"], entry["parts"], _summed_counters(entry["parts"]) if shard == 0 else None,
             False) for entry in manifest["tables"]]


def load(shards: Any, manifest: dict, location: Location) -> None:
    """Fill the (empty) tables of ``shards`` from the snapshot at ``location``: each shard reads
    its own part, or streams every part keeping its rows (another shard count)."""
    shards.call_parallel("import_snapshot", {
        s: (location.url, import_plan(manifest, s, len(shards))) for s in range(len(shards))})


def recovery_source(series: "SnapshotSeries | None", wal_directory: str | None,
                    snapshot: str | os.PathLike | None, lost: list[int],
                    num_shards: int) -> tuple[Location, dict, str | None]:
    """Where lost shards are rebuilt from: (snapshot location, its checked manifest, the
    write-ahead log directory to replay or None). ``snapshot`` None: the newest intact one of
    ``series`` (and the log, if the bank keeps one and that snapshot started a segment)."""
    if snapshot is None:
        path = None if series is None else series.latest()
        if path is None:
            raise ValueError(f"shards {lost} are lost and there is no snapshot to rebuild "
                             f"them from: call enable_snapshots(directory) before a loss "
                             f"(or pass snapshot=<path>)")
    else:
        path, wal_directory = os.fspath(snapshot), None
    location = Location(path)
    manifest = read_manifest(location)
    if manifest["num_shards"] != num_shards:
        raise ValueError(f"snapshot {location.url!r} has {manifest['num_shards']} shards, "
                         f"this bank {num_shards}: recover() rebuilds a shard from its own part")
    if manifest["write_ahead_log"] is None:
        wal_directory = None
    return location, manifest, wal_directory


def restore_shard(actor: Any, shard: int, configs: dict[str, TableConfig], location: Location,
                  manifest: dict, wal_directory: str | None, wal_durability: str = "process") -> dict[str, Any]:
    """Fill the new, empty actor of lost shard ``shard`` from its part of the snapshot, then replay
    its write-ahead log since that snapshot (``wal_directory``). Returns its rows per table and the
    number of calls replayed."""
    for name, config in configs.items():
        actor.create_table(name, config, 1024).result()
    actor.import_snapshot(location.url, import_plan(manifest, shard, manifest["num_shards"])).result()
    replayed = 0
    if wal_directory is not None:
        replayed = actor.replay_write_ahead_log(wal_directory, manifest["write_ahead_log"][shard],
                                                wal_durability).result()
    rows = {name: table["rows"] for name, table in actor.stats().result().items()}
    return {"rows": rows, "replayed_calls": replayed}


class BankSnapshots:
    """The snapshots a bank keeps of itself (``KnowledgeBank.enable_snapshots``): the numbered
    ``series`` (None until enabled), the write-ahead log directory (None: no log), the ``lock``
    that orders snapshots with recovery, and the supervised thread taking them automatically."""

    def __init__(self) -> None:
        self.series: SnapshotSeries | None = None
        self.wal_directory: str | None = None
        self.wal_durability = "process"
        self.lock = threading.RLock()
        self._thread: Any = None
        self._stop: Any = None

    def use(self, shards: Any, series: SnapshotSeries, write_ahead_log: bool, durability: str = "process") -> None:
        """Keep snapshots in ``series`` from now on (the shards' log in its ``wal`` directory when
        ``write_ahead_log``; a log switched off is stopped on every shard)."""
        with self.lock:
            if self.wal_directory is not None and not write_ahead_log:
                shards.call_all("stop_write_ahead_log")
            self.series = series
            self.wal_directory = series.wal_directory if write_ahead_log else None
            self.wal_durability = durability

    def take(self, shards: Any, configs: dict[str, TableConfig]) -> str:
        """Save the next snapshot of the series (every shard's log starts a new segment there);
        prune the ones beyond ``keep`` and the log segments they no longer need. Its path."""
        if self.series is None:
            raise ValueError("snapshot() needs a snapshot directory: call enable_snapshots(directory)")
        with self.lock:
            number, path = self.series.next_path()
            manifest = save(shards, configs, Location(path), self.wal_directory, self.wal_durability)
            if self.wal_directory is not None:
                for shard, segment in enumerate(manifest["write_ahead_log"]):
                    truncate_before(self.wal_directory, shard, segment)
            self.series.prune(number)
            return path

    def start(self, take: Callable[[], Any], max_version: Callable[[], int],
              every_seconds: float | None, every_versions: int | None, poll_seconds: float) -> None:
        """Call ``take()`` every ``every_seconds`` and/or once ``max_version()`` grew by
        ``every_versions``, checked every ``poll_seconds`` by a supervised thread (a failed
        snapshot is retried with backoff; see :meth:`status`)."""
        from carlskit.cluster import LongRunningTasks, ThreadStopFlag

        self._stop = ThreadStopFlag()
        self._thread = LongRunningTasks(None, "carlskit-bank-snapshots", piece="snapshotter")
        self._thread.launch("snapshots", _take_when_due, lambda: (
            self._stop, take, max_version, every_seconds, every_versions, poll_seconds))

    def stop(self) -> None:
        """Stop the automatic snapshots (if running) and wait for the thread."""
        if self._thread is not None:
            self._thread.stop(self._stop, timeout=60)
            self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def status(self) -> dict | None:
        """The automatic snapshots' state (None when off)."""
        return None if self._thread is None else self._thread.status()


def _take_when_due(stop: Any, take: Callable[[], Any], max_version: Callable[[], int],
                   every_seconds: float | None, every_versions: int | None,
                   poll_seconds: float) -> None:
    last_time = time.monotonic()
    last_version = max_version()
    while not stop.is_set():
        time.sleep(poll_seconds)
        due = every_seconds is not None and time.monotonic() - last_time >= every_seconds
        version = None
        if not due and every_versions is not None:
            version = max_version()
            due = version >= last_version + every_versions
        if due and not stop.is_set():
            version = max_version() if version is None else version
            take()
            last_time, last_version = time.monotonic(), version
