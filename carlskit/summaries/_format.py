"""The carlskit summary file format (version 2): append-only, checksummed, columnar records.

A log directory holds many files; each is written by exactly one process (one aggregator actor or
one direct writer) and only ever appended to, so readers never need a lock. A file never outlives
its writer: a restarted aggregator opens a new file, so a torn tail stays a torn tail.

File names::

    <origin>.level0.summaries      every record written (full resolution)
    <origin>.level<k>.summaries    scalars only, decimated: every (16**k)-th point of each name,
                                   counted per name within that origin (k = 1, 2, 3)

File layout (all integers little-endian)::

    file header, 20 bytes:  magic b"CARLSSUM" | u32 format_version (= 2) | u32 level
                            | u32 crc32(the 16 bytes before)
    record*:                u32 payload_length | u32 crc32(payload_length as 4 bytes)
                            | u32 crc32(payload) | payload (payload_length bytes)

``crc32`` is zlib's CRC-32 (IEEE 802.3). The length has its own checksum so a corrupted length is
told apart from a record still being written; the header has its own so a flipped level or version
is not silently believed. Every byte of a file is covered by a checksum.

Payload (one summary name, a batch of entries, columnar)::

    u16 kind | u16 name_length | u32 entry_count | u32 column_count | u32 reserved (= 0)
    | u64 writer_id | u64 sequence
    name (UTF-8, name_length bytes)
    column_count x (u8 dtype code | 3 bytes zero | u32 element_count)
    column data, back to back, in the order of the descriptors

``writer_id`` (random per writer object, copies included) and ``sequence`` (numbered per writer
and shard, one number per flush of that shard) identify the batch the record came from. A writer
re-sends a batch its aggregator did not acknowledge (the aggregator's worker died), so a batch can
be in the files twice (written, then the worker died before the acknowledgement); readers keep the
first record of each ``(kind, name, writer_id, sequence)`` and drop repeats: at-least-once on disk,
exactly-once as read.

dtype codes: ``q`` int64, ``d`` float64, ``I`` uint32, ``Q`` uint64, ``B`` uint8. Columns by kind
(n = entry_count):

    1 scalars     steps q[n], wall_times d[n], values d[n]
    2 histograms  steps q[n], wall_times d[n], bin_counts I[n],
                  data d[sum(2*b+1)]: per entry its b+1 edges then its b counts
    3 samples     steps q[n], wall_times d[n], original_sizes Q[n], lengths I[n],
                  values d[sum(lengths)]: a uniform random subsample of each array, in order
    4 texts       steps q[n], wall_times d[n], lengths I[n], data B[sum(lengths)] (UTF-8)

Version 1 (read, never written) had a 16-byte header without its checksum and payloads without
``writer_id``/``sequence`` (never de-duplicated).

Reading rules: a reader returns every complete record. A tail shorter than a record header, or a
header whose payload is not all there yet, is *incomplete*: not an error; the reader keeps its
offset there and picks the record up once it is complete. A record whose length checksum or payload
checksum does not match, or a file header that fails its checksum, is *corrupt*: with
``on_corrupt="raise"`` (the default) the reader raises :class:`CorruptRecordError` (a
:class:`carlskit.CorruptFileError`) naming the file and offset; with ``on_corrupt="skip"`` it counts
the record in ``SummaryReader.corrupt_records``, skips it (scanning forward to the next valid record
when the length itself is damaged; a file whose header is damaged, for good) and goes on.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np

from carlskit._errors import CorruptFileError

MAGIC = b"CARLSSUM"
FORMAT_VERSION = 2
FILE_HEADER_V1 = struct.Struct("<8sII")
FILE_HEADER = struct.Struct("<8sIII")  # version 2: the v1 fields, then crc32 of them
RECORD_HEADER = struct.Struct("<III")
PAYLOAD_HEADER_V1 = struct.Struct("<HHIII")
PAYLOAD_HEADER = struct.Struct("<HHIIIQQ")  # version 2: v1's, then writer_id, sequence
COLUMN_DESCRIPTOR = struct.Struct("<c3xI")

SCALARS, HISTOGRAMS, SAMPLES, TEXTS = 1, 2, 3, 4
KIND_NAMES = {SCALARS: "scalars", HISTOGRAMS: "histograms", SAMPLES: "samples", TEXTS: "texts"}

DECIMATION_FACTOR = 16
DECIMATION_LEVELS = 3

_DTYPES = {b"q": np.dtype("<i8"), b"d": np.dtype("<f8"), b"I": np.dtype("<u4"),
           b"Q": np.dtype("<u8"), b"B": np.dtype("u1")}
_CODES = {dtype: code for code, dtype in _DTYPES.items()}


class CorruptRecordError(CorruptFileError):
    """A record (or file header) whose checksum does not match: the file was damaged after it was
    written. A :class:`carlskit.CorruptFileError` (so a ``ValueError``) with ``path``, ``offset``
    and ``reason``."""

    def __init__(self, path: str, offset: int, reason: str):
        self.offset, self.reason = offset, reason
        super().__init__(path, f"summary record at byte {offset}: {reason}")

    def __reduce__(self):
        return (type(self), (self.path, self.offset, self.reason))


def file_header(level: int) -> bytes:
    head = FILE_HEADER_V1.pack(MAGIC, FORMAT_VERSION, level)
    return head + zlib.crc32(head).to_bytes(4, "little")


def header_size(data: bytes) -> int:
    """Bytes of the file header, from the first 16 bytes (its version): 20, or 16 for version 1."""
    return FILE_HEADER_V1.size if FILE_HEADER_V1.unpack_from(data, 0)[1] == 1 else FILE_HEADER.size


def check_file_header(data: bytes, path: str) -> tuple[int, int]:
    """Return ``(version, level)`` from a file's header; raise :class:`CorruptRecordError` (at
    byte 0) on a foreign or damaged header."""
    magic, version, level = FILE_HEADER_V1.unpack_from(data, 0)
    if magic != MAGIC:
        raise CorruptRecordError(path, 0, f"not a carlskit summary file header (magic {magic!r})")
    if version == 1:
        return version, level  # version 1 headers carry no checksum
    (crc,) = struct.unpack_from("<I", data, FILE_HEADER_V1.size)
    if zlib.crc32(data[:FILE_HEADER_V1.size]) != crc:
        raise CorruptRecordError(path, 0, "file header checksum mismatch")
    if version != FORMAT_VERSION:
        raise CorruptRecordError(path, 0, f"summary format version {version}; this reader reads 1 and 2")
    if not 0 <= level <= DECIMATION_LEVELS:
        raise CorruptRecordError(path, 0, f"level {level} in the header is not in [0, {DECIMATION_LEVELS}]")
    return version, level


def encode_record(kind: int, name: str, count: int, columns: list[np.ndarray],
                  writer_id: int = 0, sequence: int = 0) -> bytes:
    """One framed record (header + payload) holding ``count`` entries of one summary name, from
    batch ``sequence`` of writer ``writer_id``."""
    name_bytes = name.encode("utf-8")
    parts = [PAYLOAD_HEADER.pack(kind, len(name_bytes), count, len(columns), 0, writer_id, sequence),
             name_bytes]
    arrays = []
    for column in columns:
        array = np.ascontiguousarray(column)
        array = array.astype(array.dtype.newbyteorder("<"), copy=False)
        parts.append(COLUMN_DESCRIPTOR.pack(_CODES[array.dtype], array.size))
        arrays.append(array)
    parts.extend(memoryview(array).cast("B") for array in arrays)
    payload = b"".join(parts)
    length = len(payload).to_bytes(4, "little")
    return RECORD_HEADER.pack(len(payload), zlib.crc32(length), zlib.crc32(payload)) + payload


@dataclass
class Record:
    kind: int
    name: str
    count: int
    columns: list[np.ndarray]  # zero-copy views into the block the record was read from
    batch: tuple[int, int] | None = None  # (writer_id, sequence); None in version 1 files


def decode_payload(block: bytes, start: int, length: int, version: int = FORMAT_VERSION) -> Record:
    if version == 1:
        kind, name_length, count, column_count, _ = PAYLOAD_HEADER_V1.unpack_from(block, start)
        batch, position = None, start + PAYLOAD_HEADER_V1.size
    else:
        kind, name_length, count, column_count, _, writer_id, sequence = PAYLOAD_HEADER.unpack_from(block, start)
        batch, position = (writer_id, sequence), start + PAYLOAD_HEADER.size
    name = bytes(block[position:position + name_length]).decode("utf-8")
    position += name_length
    descriptors = []
    for _ in range(column_count):
        code, size = COLUMN_DESCRIPTOR.unpack_from(block, position)
        descriptors.append((_DTYPES[code], size))
        position += COLUMN_DESCRIPTOR.size
    columns = []
    for dtype, size in descriptors:
        columns.append(np.frombuffer(block, dtype=dtype, count=size, offset=position))
        position += size * dtype.itemsize
    if position != start + length:
        raise ValueError(f"payload layout ends at {position - start} bytes, length says {length}")
    return Record(kind, name, count, columns, batch)


def scan_records(block: bytes, path: str, base_offset: int, on_corrupt: str, version: int = FORMAT_VERSION):
    """Parse complete records from ``block`` (bytes of a file starting at ``base_offset``).

    Returns ``(records, consumed, corrupt)``: the decoded records, how many bytes of ``block`` were
    consumed (the rest is an incomplete tail to re-read later) and how many corrupt records were
    skipped.
    """
    records, corrupt = [], 0
    position, end = 0, len(block)
    header_size = RECORD_HEADER.size
    while end - position >= header_size:
        length, length_crc, payload_crc = RECORD_HEADER.unpack_from(block, position)
        if zlib.crc32(block[position:position + 4]) != length_crc:
            reason = "length checksum mismatch"
        elif end - position - header_size < length:
            break  # still being written (or torn by a crash): not an error
        else:
            start = position + header_size
            if zlib.crc32(memoryview(block)[start:start + length]) == payload_crc:
                try:
                    records.append(decode_payload(block, start, length, version))
                except (ValueError, KeyError, struct.error, UnicodeDecodeError) as error:
                    reason = f"payload checksum matches but layout is invalid: {error}"
                else:
                    position = start + length
                    continue
            else:
                reason = "payload checksum mismatch"
        if on_corrupt == "raise":
            raise CorruptRecordError(path, base_offset + position, reason)
        corrupt += 1
        if reason.startswith("length"):  # the length is untrustworthy: resynchronise
            next_position = _next_valid_record(block, position + 1)
            position = end if next_position is None else next_position
        else:  # the length checksum held, so the record's extent is known: step over it
            position += header_size + length
    return records, position, corrupt


def _next_valid_record(block: bytes, position: int) -> int | None:
    """First offset >= position holding a record whose both checksums match, if any."""
    view = memoryview(block)
    end = len(block)
    while end - position >= RECORD_HEADER.size:
        length, length_crc, payload_crc = RECORD_HEADER.unpack_from(block, position)
        start = position + RECORD_HEADER.size
        if (
            zlib.crc32(view[position:position + 4]) == length_crc
            and end - start >= length
            and zlib.crc32(view[start:start + length]) == payload_crc
        ):
            return position
        position += 1
    return None
