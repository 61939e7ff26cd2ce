"""Appending batches to one origin's summary files: full resolution plus decimated scalar copies.

One helper serves both the direct writer (no cluster) and each aggregator actor.
"""

from __future__ import annotations

import os
import socket
import threading
import uuid
from pathlib import Path

import numpy as np

from carlskit.summaries import _format

Batch = tuple[int, str, int, list[np.ndarray]]  # (kind, name, entry_count, columns)


def new_origin(prefix: str) -> str:
    """A file-name stem unique to one writing process lifetime (never reused after a crash)."""
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())[:32]
    return f"{prefix}-{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def level_path(logdir: Path, origin: str, level: int) -> Path:
    return logdir / f"{origin}.level{level}.summaries"


class SummaryFiles:
    """Append-only files of one origin: ``level0`` holds everything, ``level<k>`` every 16**k-th
    scalar of each name. Each ``append`` is one ``write`` per file, so a crash tears at most the
    last batch, which readers ignore."""

    def __init__(self, logdir: str | os.PathLike, origin: str):
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.origin = origin
        self._files: dict[int, int] = {}  # level -> file descriptor, opened on first use
        self._points_seen: dict[str, int] = {}  # per scalar name, for decimation
        self._lock = threading.Lock()
        self.records_written = 0
        self.entries_written = 0

    def _descriptor(self, level: int) -> int:
        descriptor = self._files.get(level)
        if descriptor is None:
            path = level_path(self.logdir, self.origin, level)
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_EXCL, 0o644)
            os.write(descriptor, _format.file_header(level))
            self._files[level] = descriptor
        return descriptor

    def append(self, batches: list[Batch], writer_id: int = 0, sequence: int = 0) -> int:
        """Write every batch as one record (plus decimated scalar records) marked as batch
        ``sequence`` of writer ``writer_id`` (readers drop a repeat of that mark); return entries
        written."""
        per_level: dict[int, list[bytes]] = {}
        entries = 0
        with self._lock:
            for kind, name, count, columns in batches:
                if count == 0:
                    continue
                mark = (writer_id, sequence)
                per_level.setdefault(0, []).append(_format.encode_record(kind, name, count, columns, *mark))
                entries += count
                if kind == _format.SCALARS:
                    self._decimate(name, count, columns, per_level, mark)
            for level in sorted(per_level):
                _write_all(self._descriptor(level), b"".join(per_level[level]))
                self.records_written += len(per_level[level])
            self.entries_written += entries
        return entries

    def _decimate(self, name: str, count: int, columns: list[np.ndarray], per_level, mark) -> None:
        seen = self._points_seen.get(name, 0)
        self._points_seen[name] = seen + count
        for level in range(1, _format.DECIMATION_LEVELS + 1):
            stride = _format.DECIMATION_FACTOR**level
            first = (-seen) % stride  # index in this batch of the next multiple of stride
            if first >= count:
                break  # coarser levels have a larger stride, so they keep nothing either
            kept = [column[first::stride] for column in columns]
            per_level.setdefault(level, []).append(
                _format.encode_record(_format.SCALARS, name, len(kept[0]), kept, *mark)
            )

    def flush_to_disk(self) -> None:
        with self._lock:
            for descriptor in self._files.values():
                os.fsync(descriptor)

    def close(self) -> None:
        with self._lock:
            for descriptor in self._files.values():
                try:
                    os.fsync(descriptor)
                finally:
                    os.close(descriptor)
            self._files.clear()


def _write_all(descriptor: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(descriptor, view)
        view = view[written:]
