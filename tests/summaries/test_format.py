"""The file format: round trips, torn tails ignored, corrupted records detected by CRC32."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

from carlskit._errors import CorruptFileError
from carlskit.summaries import CorruptRecordError, SummaryReader, SummaryWriter, _format


def write_batches(logdir, batches: int, points: int) -> list:
    """Each flush writes one record per name; returns the level-0 file path."""
    with SummaryWriter(logdir, flush_every_seconds=60) as writer:
        for batch in range(batches):
            for index in range(points):
                step = batch * points + index
                writer.scalar("loss", 1.0 / (step + 1), step)
            writer.flush()
    (path,) = sorted(logdir.glob("*.level0.summaries"))
    return path


def record_offsets(path) -> list[int]:
    data = path.read_bytes()
    offsets, position = [], _format.FILE_HEADER.size
    while position < len(data):
        offsets.append(position)
        (length,) = np.frombuffer(data, "<u4", 1, position)
        position += _format.RECORD_HEADER.size + int(length)
    return offsets


def test_record_round_trip_every_kind():
    columns = [np.arange(3, dtype=np.int64), np.array([0.5, 1.5, 2.5]), np.array([1.0, np.nan, -np.inf])]
    framed = _format.encode_record(_format.SCALARS, "ünïcode/name", 3, columns)
    records, consumed, corrupt = _format.scan_records(framed, "memory", 0, "raise")
    assert consumed == len(framed) and corrupt == 0
    (record,) = records
    assert (record.kind, record.name, record.count) == (_format.SCALARS, "ünïcode/name", 3)
    for got, expected in zip(record.columns, columns):
        np.testing.assert_array_equal(got, expected)


def test_file_header_is_versioned_and_checksummed(tmp_path):
    path = write_batches(tmp_path, 1, 5)
    magic, version, level, crc = _format.FILE_HEADER.unpack_from(path.read_bytes(), 0)
    assert (magic, version, level) == (b"CARLSSUM", 2, 0)
    assert crc == zlib.crc32(path.read_bytes()[:16])
    foreign = tmp_path / "other.level0.summaries"
    foreign.write_bytes(b"NOTOURS!" + bytes(12))
    with pytest.raises(CorruptFileError, match="not a carlskit summary file"):
        SummaryReader(tmp_path).names()


@pytest.mark.parametrize("offset", range(20))
def test_a_damaged_file_header_byte_is_a_corrupt_file_naming_it(tmp_path, offset):
    path = write_batches(tmp_path, 2, 5)
    flip_byte(path, offset)  # e.g. the level: believed, it would file the records under level 90
    with pytest.raises(CorruptFileError, match="level0.summaries") as caught:
        SummaryReader(tmp_path).names()
    assert caught.value.path == str(path)
    reader = SummaryReader(tmp_path, on_corrupt="skip")
    assert reader.names() == [] and reader.corrupt_records == 1


def test_every_single_byte_corruption_of_a_summary_file_is_detected(tmp_path):
    with SummaryWriter(tmp_path, flush_every_seconds=60) as writer:
        writer.scalar("loss", 0.5, 3)
        writer.array("weights", np.arange(4.0), 3, bins=2)
        writer.array("sampled", np.arange(4.0), 3, mode="samples")
        writer.text("note", "hé", 3)
    (path,) = tmp_path.glob("*.level0.summaries")
    intact = path.read_bytes()
    for offset in range(len(intact)):
        flip_byte(path, offset)
        with pytest.raises(CorruptFileError) as caught:
            reader = SummaryReader(tmp_path)
            for name in reader.names():
                pass
        assert caught.value.path == str(path), offset
        path.write_bytes(intact)
    reader = SummaryReader(tmp_path)
    assert reader.names() == ["loss", "note", "sampled", "weights"]


def test_version_1_files_without_header_checksum_or_batch_marks_are_still_read(tmp_path):
    columns = [np.arange(3, dtype=np.int64), np.array([0.5, 1.5, 2.5]), np.array([1.0, 2.0, 3.0])]
    name = b"old/loss"
    payload = _format.PAYLOAD_HEADER_V1.pack(_format.SCALARS, len(name), 3, 3, 0) + name
    payload += b"".join(_format.COLUMN_DESCRIPTOR.pack(code, 3) for code in (b"q", b"d", b"d"))
    payload += b"".join(column.tobytes() for column in columns)
    record = _format.RECORD_HEADER.pack(len(payload), zlib.crc32(len(payload).to_bytes(4, "little")),
                                        zlib.crc32(payload)) + payload
    (tmp_path / "old.level0.summaries").write_bytes(_format.FILE_HEADER_V1.pack(b"CARLSSUM", 1, 0) + record)
    frame = SummaryReader(tmp_path).scalars("old/loss")
    assert frame["step"].tolist() == [0, 1, 2] and frame["value"].tolist() == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("cut", [1, 5, 11, 12, 13, 40])
def test_torn_final_record_is_ignored_then_picked_up(tmp_path, cut):
    path = write_batches(tmp_path, 3, 50)
    full = path.read_bytes()
    last = record_offsets(path)[-1]
    path.write_bytes(full[: last + cut])  # a crash in the middle of the last write
    reader = SummaryReader(tmp_path)
    frame = reader.scalars("loss")
    np.testing.assert_array_equal(frame["step"], np.arange(100))
    assert reader.corrupt_records == 0
    with open(path, "ab") as file:  # the rest arrives: the reader resumes at the kept offset
        file.write(full[last + cut:])
    np.testing.assert_array_equal(reader.scalars("loss")["step"], np.arange(150))


def flip_byte(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


def test_corrupted_payload_raises_by_default_and_is_skipped_and_counted_on_request(tmp_path):
    path = write_batches(tmp_path, 3, 50)
    middle = record_offsets(path)[1]
    flip_byte(path, middle + _format.RECORD_HEADER.size + 30)
    with pytest.raises(CorruptRecordError, match="payload checksum mismatch") as caught:
        SummaryReader(tmp_path).scalars("loss")
    assert caught.value.offset == middle and caught.value.path == str(path)
    reader = SummaryReader(tmp_path, on_corrupt="skip")
    steps = reader.scalars("loss")["step"].to_numpy()
    np.testing.assert_array_equal(steps, np.r_[0:50, 100:150])
    assert reader.corrupt_records == 1


def test_corrupted_length_is_detected_and_skip_mode_resynchronises(tmp_path):
    path = write_batches(tmp_path, 3, 50)
    middle = record_offsets(path)[1]
    flip_byte(path, middle + 1)  # the length field: its own CRC tells it apart from a torn tail
    with pytest.raises(CorruptRecordError, match="length checksum mismatch"):
        SummaryReader(tmp_path).scalars("loss")
    reader = SummaryReader(tmp_path, on_corrupt="skip")
    np.testing.assert_array_equal(reader.scalars("loss")["step"], np.r_[0:50, 100:150])
    assert reader.corrupt_records == 1


def test_reader_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="on_corrupt"):
        SummaryReader(tmp_path, on_corrupt="ignore")
    with pytest.raises(TypeError, match="logdir"):
        SummaryReader(42)
    with pytest.raises(ValueError, match="max_points"):
        SummaryReader(tmp_path).scalars("loss", max_points=0)
    with pytest.raises(ValueError, match="kind"):
        SummaryReader(tmp_path).names(kind="images")


def test_crc_is_zlib_crc32_of_the_payload(tmp_path):
    path = write_batches(tmp_path, 1, 10)
    data = path.read_bytes()
    position = _format.FILE_HEADER.size
    length, length_crc, payload_crc = _format.RECORD_HEADER.unpack_from(data, position)
    payload = data[position + 12: position + 12 + length]
    assert length_crc == zlib.crc32(length.to_bytes(4, "little"))
    assert payload_crc == zlib.crc32(payload)
    assert os.path.getsize(path) == position + 12 + length
