"""The bank's opt-in write-ahead log: per shard, appended by the shard on its worker.

Every call that changes a shard (``lookup`` — it counts lookups, may insert rows and applies cached
gradients —, ``update``, ``apply_gradients``, ``flush``, and a ttl flush noticed by a read) is
appended to the shard's current segment *before* it is applied and acknowledged, with the time the
shard applied it. Replaying the segments written since a snapshot onto that snapshot's part, each
record at its recorded time, therefore rebuilds the shard exactly as it was (the lazy update rule is
a deterministic function of the calls and their times).

Records: ``b"CKW1" | u64 body length | u32 CRC-32 of the body | body``, the body being the call as
the direct path encodes it (a JSON header plus raw array buffers; no pickle). CRC-32 rather than
SHA-256 because it is computed on the hot path of every write (2.6 GB/s here against 1.2 GB/s):
it detects torn or damaged records, which is what a log needs. One ``writev`` per record, no
copy of the arrays. A record cut short at the very end of the last segment was never acknowledged
(the shard died while writing it) and is ignored; a bad record anywhere else is a
:class:`carlskit.CorruptFileError` naming the segment.

Segments live in ``<snapshot directory>/wal/shard-NNNNN/SSSSSSSSSSSS.wal``. Each snapshot starts a
new segment under the shard's lock (the exact cut between the part and the log) and records its
number in the manifest; segments older than the latest committed snapshot's are deleted, so the
log is truncated at each snapshot.

Durability (``KnowledgeBank.enable_snapshots(..., durability=)``):

- ``"process"`` (default): records are written, not fsync'd. They survive the loss of the worker
  process (the kernel holds them), not the loss of the machine (its page cache).
- ``"machine"``: a write is acknowledged only once an ``fdatasync`` of its segment covered its
  record (the segment's directory is fsync'd when the segment is created, so the file itself
  survives too). The syncs are grouped: the first call that needs one syncs everything appended so
  far, after it released the shard's lock, and calls that arrive meanwhile wait for the next sync,
  which covers all of them (leader-based group commit, as databases do). No timer: a timer only
  adds latency when one caller writes at a time (a Dask actor runs one call at a time), and callers
  that overlap group by themselves. Reads (``lookup`` without ``insert_missing``, ``nearest``,
  ``sample``, ``row_metadata``) do not wait: their records (lookup counts, a ttl flush they
  triggered) become durable with the next write's sync, and a machine loss may cost them. The cost
  on ``apply_gradients`` is in BENCHMARKS.md.
"""

from __future__ import annotations

import os
import re
import struct
import threading
import zlib
from typing import Any, Iterator

import numpy as np

from carlskit._errors import CorruptFileError
from carlskit.bank._direct import decode, encode

_MAGIC = b"CKW1"
_PREFIX = struct.Struct("<4sQI")  # magic, body length, crc32(body)
_BODY_HEAD = struct.Struct("<II")  # header length, number of array frames
_SEGMENT = re.compile(r"^(\d{12})\.wal$")
DURABILITY = ("process", "machine")

# Looked up at call time, so that a test can put a layer between the log and the disk that keeps
# only the bytes a sync covered (tests/bank/test_wal_durability.py): the log is then tested by what
# survives, not by trusting the call.
_fdatasync = getattr(os, "fdatasync", os.fsync)  # macOS has no fdatasync


def shard_directory(wal_directory: str, shard: int) -> str:
    return os.path.join(wal_directory, f"shard-{shard:05d}")


def segment_numbers(directory: str) -> list[int]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for name in names if (m := _SEGMENT.match(name)))


def segment_path(directory: str, number: int) -> str:
    return os.path.join(directory, f"{number:012d}.wal")


def _write_all(fd: int, buffers: list[Any]) -> None:
    views = [memoryview(b).cast("B") for b in buffers]
    views = [v for v in views if len(v)]
    while views:
        written = os.writev(fd, views[:1024])
        while written and views:
            if written >= len(views[0]):
                written -= len(views.pop(0))
            else:
                views[0] = views[0][written:]
                written = 0


def _sync_directory(directory: str) -> None:
    """fsync a directory, so that the names created in it survive the loss of the machine."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class WriteAheadLog:
    """The open segment of one shard's log; ``durability`` as in the module doc.

    :meth:`append` (under the shard's lock) returns the record's end, a ticket;
    :meth:`wait_durable` (after the shard's lock is released) returns once a sync covered it.
    """

    def __init__(self, wal_directory: str, shard: int, segment: int, durability: str = "process") -> None:
        if durability not in DURABILITY:
            raise ValueError(f"durability must be one of {list(DURABILITY)}, got {durability!r}")
        self.directory = shard_directory(wal_directory, shard)
        os.makedirs(self.directory, exist_ok=True)
        self.wal_directory = wal_directory
        self.segment = segment
        self.durability = durability
        self.path = segment_path(self.directory, segment)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.appended = 0  # bytes appended (tickets)
        self.durable = 0  # bytes a sync covered
        self.syncs = 0
        self._synced = threading.Condition()
        self._syncing = False
        if durability == "machine":
            _sync_directory(self.directory)
            _sync_directory(os.path.dirname(self.directory))

    @classmethod
    def next_segment(cls, wal_directory: str, shard: int) -> int:
        numbers = segment_numbers(shard_directory(wal_directory, shard))
        return numbers[-1] + 1 if numbers else 0

    def append(self, method: str, now: float, args: tuple) -> None:
        header, frames = encode([method, now, list(args)])
        lengths = struct.pack(f"<{len(frames)}Q", *[f.nbytes for f in frames])
        head = _BODY_HEAD.pack(len(header), len(frames))
        body = [head, lengths, header, *frames]
        crc = 0
        for part in body:
            crc = zlib.crc32(part, crc)
        size = sum(memoryview(p).nbytes for p in body)
        _write_all(self._fd, [_PREFIX.pack(_MAGIC, size, crc), *body])
        self.appended += _PREFIX.size + size
        return self.appended

    def wait_durable(self, ticket: int) -> None:
        """Return once the record ending at ``ticket`` survives the machine's loss (``"machine"``;
        at once for ``"process"``). Call it without holding the shard's lock: calls meanwhile
        append, and one sync covers them all."""
        if self.durability != "machine":
            return
        with self._synced:
            while self.durable < ticket:
                if self._syncing:  # a sync is running: the next one (or this one) covers us
                    self._synced.wait()
                    continue
                self._syncing, target, fd = True, self.appended, self._fd
                self._synced.release()
                try:
                    _fdatasync(fd)
                finally:
                    self._synced.acquire()
                    self._syncing = False
                    self._synced.notify_all()
                self.durable, self.syncs = max(self.durable, target), self.syncs + 1

    def close(self) -> None:
        """Close the segment; with ``"machine"``, after a last sync (a new segment follows)."""
        with self._synced:
            while self._syncing:
                self._synced.wait()
            if self._fd >= 0:
                if self.durability == "machine" and self.durable < self.appended:
                    _fdatasync(self._fd)
                    self.durable, self.syncs = self.appended, self.syncs + 1
                os.close(self._fd)
                self._fd = -1
            self._synced.notify_all()

    def __del__(self) -> None:
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)
            self._fd = -1


def read_segment(path: str, last: bool) -> Iterator[tuple[str, float, list]]:
    """The records of one segment: (method, time, args). A record cut short at the end is skipped
    when ``last`` (the shard died writing it: never acknowledged), else CorruptFileError."""
    with open(path, "rb") as handle:
        data = handle.read()
    position, number = 0, 0
    while position < len(data):
        if len(data) - position < _PREFIX.size:
            if last:
                return
            raise CorruptFileError(path, f"record {number} is cut short")
        magic, size, crc = _PREFIX.unpack_from(data, position)
        if magic != _MAGIC:
            raise CorruptFileError(path, f"record {number} at byte {position} has no record mark")
        start = position + _PREFIX.size
        if start + size > len(data):
            if last:
                return
            raise CorruptFileError(path, f"record {number} is cut short")
        body = memoryview(data)[start:start + size]
        if zlib.crc32(body) != crc:
            raise CorruptFileError(path, f"record {number} at byte {position} fails its CRC-32")
        header_length, count = _BODY_HEAD.unpack_from(body, 0)
        offset = _BODY_HEAD.size
        lengths = struct.unpack_from(f"<{count}Q", body, offset)
        offset += 8 * count
        header = body[offset:offset + header_length]
        offset += header_length
        frames = []
        for length in lengths:
            frames.append(body[offset:offset + length])
            offset += length
        method, now, args = decode(header, frames)
        yield method, now, [np.array(a) if isinstance(a, np.ndarray) else a for a in args]
        position = start + size
        number += 1


def records_since(wal_directory: str, shard: int, first_segment: int
                  ) -> Iterator[tuple[str, float, list]]:
    """Every record of ``shard`` from segment ``first_segment`` on, in order."""
    directory = shard_directory(wal_directory, shard)
    numbers = [n for n in segment_numbers(directory) if n >= first_segment]
    if numbers and numbers[0] != first_segment:
        raise CorruptFileError(segment_path(directory, first_segment),
                               "write-ahead log segment is missing")
    for index, number in enumerate(numbers):
        yield from read_segment(segment_path(directory, number), last=index == len(numbers) - 1)


def truncate_before(wal_directory: str, shard: int, segment: int) -> None:
    """Delete the shard's segments older than ``segment`` (covered by a committed snapshot)."""
    directory = shard_directory(wal_directory, shard)
    for number in segment_numbers(directory):
        if number < segment:
            try:
                os.remove(segment_path(directory, number))
            except FileNotFoundError:
                pass
