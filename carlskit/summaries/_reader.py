"""``SummaryReader``: incremental, crash-tolerant reads of a summary log directory."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pandas as pd

from carlskit import _checks
from carlskit.summaries import _format


class _Level:
    """What has been read so far of the files of one decimation level."""

    def __init__(self):
        self.offsets: dict[Path, int] = {}  # bytes consumed per file (header included)
        self.versions: dict[Path, int] = {}  # format version per file, from its header
        self.records: dict[tuple[int, str], list[_format.Record]] = {}
        self.counts: dict[tuple[int, str], int] = {}
        # (writer_id, sequence) of the records kept, per summary: a batch re-sent after its
        # aggregator died may be in the files twice (at-least-once delivery); reads are exactly-once.
        self.batches: dict[tuple[int, str], set[tuple[int, int]]] = {}
        self.duplicates = 0


class SummaryReader:
    """Read the summaries in ``logdir`` while writers are still writing.

    Every query first reads what was appended since the last one (file offsets are kept, so a
    refresh costs one ``stat`` per file when nothing changed). Only complete records are returned;
    a torn or half-written last record is left for a later refresh. Scalars come back as a pandas
    DataFrame with columns ``step``, ``wall_time``, ``value``, ordered by step.

    Args:
      logdir: the writer's ``logdir``.
      on_corrupt: ``"raise"`` (default) raises :class:`CorruptRecordError` (a
        :class:`carlskit.CorruptFileError` naming the file and byte offset) on a record whose CRC32
        does not match, or on a ``*.summaries`` file whose header is not an intact carlskit one;
        ``"skip"`` skips it (such a file for good) and counts it in :attr:`corrupt_records`.

    A batch re-sent by a writer after its aggregator was lost can be in the files twice; the
    reader keeps one copy (by its writer id and sequence number) and counts the rest in
    :attr:`duplicate_records`.
    """

    def __init__(self, logdir: str | os.PathLike, *, on_corrupt: str = "raise"):
        _checks.path(logdir, "logdir")
        _checks.choice(on_corrupt, "on_corrupt", ("raise", "skip"))
        self.logdir = Path(logdir)
        if self.logdir.exists() and not self.logdir.is_dir():
            raise NotADirectoryError(f"logdir {str(self.logdir)!r} exists and is not a directory")
        self.on_corrupt = on_corrupt
        self.corrupt_records = 0
        self._levels: dict[int, _Level] = {}
        self._foreign: set[Path] = set()  # files with a bad header, skipped with on_corrupt="skip"
        self._lock = threading.RLock()

    # -- reading -------------------------------------------------------------------------------
    def refresh(self, level: int = 0) -> int:
        """Read records appended since the last call at this decimation level; return how many
        entries were new."""
        level = _checks.integer(level, "level", 0, _format.DECIMATION_LEVELS)
        with self._lock:
            state = self._levels.setdefault(level, _Level())
            new_entries = 0
            if not self.logdir.is_dir():
                return 0
            for path in sorted(self.logdir.glob(f"*.level{level}.summaries")):
                if path in self._foreign or not path.is_file():
                    continue
                new_entries += self._read_file(path, state)
            return new_entries

    def _read_file(self, path: Path, state: _Level) -> int:
        offset = state.offsets.get(path, 0)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return 0
        if size - offset < (_format.FILE_HEADER_V1.size if offset == 0 else _format.RECORD_HEADER.size):
            return 0
        with open(path, "rb") as file:
            if offset == 0:
                head = file.read(_format.FILE_HEADER.size)
                if len(head) < _format.header_size(head):
                    return 0  # a version 2 header still being written
                try:
                    version, _ = _format.check_file_header(head, str(path))
                except _format.CorruptRecordError:
                    if self.on_corrupt == "raise":
                        raise
                    self._foreign.add(path)  # skip it from now on, counted once
                    self.corrupt_records += 1
                    return 0
                state.versions[path] = version
                offset = _format.header_size(head)
            file.seek(offset)
            block = file.read(size - offset)
        records, consumed, corrupt = _format.scan_records(
            block, str(path), offset, self.on_corrupt, state.versions[path])
        self.corrupt_records += corrupt
        state.offsets[path] = offset + consumed
        new_entries = 0
        for record in records:
            key = (record.kind, record.name)
            if record.batch is not None:
                seen = state.batches.setdefault(key, set())
                if record.batch in seen:
                    state.duplicates += 1
                    continue
                seen.add(record.batch)
            state.records.setdefault(key, []).append(record)
            state.counts[key] = state.counts.get(key, 0) + record.count
            new_entries += record.count
        return new_entries

    @property
    def duplicate_records(self) -> int:
        """Records dropped as repeats of a batch already read (all levels read so far)."""
        return sum(level.duplicates for level in self._levels.values())

    def _columns(self, kind: int, name: str, level: int = 0) -> list[np.ndarray] | None:
        """Fresh, writable arrays of one summary (one copy out of the read blocks)."""
        records = self._levels[level].records.get((kind, name))
        if not records:
            return None
        return [np.concatenate(parts) for parts in zip(*(record.columns for record in records))]

    # -- queries -------------------------------------------------------------------------------
    def names(self, kind: str | None = None) -> list[str]:
        """Sorted summary names, optionally of one kind (``"scalars"``, ``"histograms"``,
        ``"samples"``, ``"texts"``)."""
        kinds = _kind_codes(kind)
        with self._lock:
            self.refresh(0)
            return sorted({name for code, name in self._levels[0].records if code in kinds})

    def scalars(self, name: str, *, max_points: int | None = None) -> pd.DataFrame:
        """Points of scalar ``name`` as a DataFrame (``step``, ``wall_time``, ``value``).

        With ``max_points``, reads the finest subsampled copy holding at most about that many
        points (each level keeps every 16th point of the one below), so plotting millions of
        points reads only thousands. Unknown names give an empty frame.
        """
        _check_name(name)
        if max_points is not None:
            _checks.positive_int(max_points, "max_points")
        with self._lock:
            level = self._choose_level(name, max_points)
            columns = self._columns(_format.SCALARS, name, level)
        if columns is None:
            return pd.DataFrame({"step": np.zeros(0, np.int64), "wall_time": np.zeros(0),
                                 "value": np.zeros(0)})
        steps, wall_times, values = columns
        order = _step_order(steps)
        if order is not None:
            steps, wall_times, values = steps[order], wall_times[order], values[order]
        return pd.DataFrame({"step": steps, "wall_time": wall_times, "value": values}, copy=False)

    def _choose_level(self, name: str, max_points: int | None) -> int:
        if max_points is None:
            self.refresh(0)
            return 0
        for level in range(_format.DECIMATION_LEVELS, 0, -1):
            self.refresh(level)
            count = self._levels[level].counts.get((_format.SCALARS, name), 0)
            if count and count * _format.DECIMATION_FACTOR > max_points:
                return level
        self.refresh(0)
        return 0

    def count(self, name: str) -> int:
        """Number of scalar points of ``name`` at full resolution."""
        _check_name(name)
        with self._lock:
            self.refresh(0)
            return self._levels[0].counts.get((_format.SCALARS, name), 0)

    def histograms(self, name: str) -> pd.DataFrame:
        """Histograms of ``name``, in step order: ``step``, ``wall_time``, ``edges`` (array), ``counts`` (array)."""
        _check_name(name)
        with self._lock:
            self.refresh(0)
            columns = self._columns(_format.HISTOGRAMS, name)
        if columns is None:
            return pd.DataFrame(columns=["step", "wall_time", "edges", "counts"])
        steps, wall_times, bins, data = columns
        edges, counts, position = [], [], 0
        for bin_count in bins.tolist():
            edges.append(data[position:position + bin_count + 1].copy())
            counts.append(data[position + bin_count + 1:position + 2 * bin_count + 1].copy())
            position += 2 * bin_count + 1
        return _in_step_order(pd.DataFrame({"step": steps, "wall_time": wall_times, "edges": edges, "counts": counts}))

    def samples(self, name: str) -> pd.DataFrame:
        """Array subsamples of ``name``, in step order: ``step``, ``wall_time``, ``original_size``, ``values``."""
        _check_name(name)
        with self._lock:
            self.refresh(0)
            columns = self._columns(_format.SAMPLES, name)
        if columns is None:
            return pd.DataFrame(columns=["step", "wall_time", "original_size", "values"])
        steps, wall_times, sizes, lengths, data = columns
        bounds = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        values = [data[bounds[i]:bounds[i + 1]].copy() for i in range(len(lengths))]
        return _in_step_order(pd.DataFrame({"step": steps, "wall_time": wall_times,
                                            "original_size": sizes.astype(np.int64), "values": values}))

    def texts(self, name: str) -> pd.DataFrame:
        """Strings logged under ``name``, in step order: ``step``, ``wall_time``, ``text``."""
        _check_name(name)
        with self._lock:
            self.refresh(0)
            columns = self._columns(_format.TEXTS, name)
        if columns is None:
            return pd.DataFrame(columns=["step", "wall_time", "text"])
        steps, wall_times, lengths, data = columns
        bounds = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        raw = data.tobytes()
        texts = [raw[bounds[i]:bounds[i + 1]].decode("utf-8") for i in range(len(lengths))]
        return _in_step_order(pd.DataFrame({"step": steps, "wall_time": wall_times, "text": texts}))

    def to_tensorboard(self, logdir: str | os.PathLike) -> dict:
        """Write every summary in this log directory to a new TensorBoard event file in
        ``logdir`` (scalars, histograms, texts; array subsamples as histograms) and return counts
        of what was written and the file's ``path``. Needs tensorboardX (``pip install
        'carlskit[tensorboard]'``); see :mod:`carlskit.summaries._tensorboard` for the mapping.
        Also ``python -m carlskit.summaries export SRC DST``."""
        _checks.path(logdir, "logdir")
        if Path(logdir).resolve() == self.logdir.resolve():
            raise ValueError(f"logdir must differ from the summaries' own directory {str(self.logdir)!r}")
        from carlskit.summaries._tensorboard import export

        with self._lock:
            return export(self, logdir)

    def __repr__(self) -> str:
        return f"SummaryReader({str(self.logdir)!r})"


def _check_name(name: object) -> None:
    _checks.instance(name, "name", str, "a str (a summary name)")


def _kind_codes(kind: str | None) -> set[int]:
    if kind is None:
        return set(_format.KIND_NAMES)
    codes = {label: code for code, label in _format.KIND_NAMES.items()}
    if kind not in codes:
        raise ValueError(f"kind must be one of {sorted(codes)} or None, got {kind!r}")
    return {codes[kind]}


def _step_order(steps: np.ndarray) -> np.ndarray | None:
    """The stable order by step of a column read in file order, or None when it is in order already.

    Every kind is returned in step order (ties in the order written): a batch re-sent after its
    aggregator was lost lands in the new aggregator's file, which the reader may read before the
    file holding the batches logged after it (issue 43's model test: texts [2, 3, 0, 1])."""
    if steps.size < 2 or bool(np.all(steps[1:] >= steps[:-1])):
        return None
    return np.argsort(steps, kind="stable")


def _in_step_order(frame: pd.DataFrame) -> pd.DataFrame:
    order = _step_order(frame["step"].to_numpy())
    return frame if order is None else frame.iloc[order].reset_index(drop=True)
