"""SummaryReader: bad arguments and damaged files give clear errors (or are skipped), never silence."""

from __future__ import annotations

import numpy as np
import pytest

from carlskit.summaries import SummaryReader, SummaryWriter


def write_points(logdir, points: int = 40) -> None:
    with SummaryWriter(logdir, flush_every_seconds=60) as writer:
        for step in range(points):
            writer.scalar("loss", float(step), step)


def test_non_str_names_raise_instead_of_reading_as_empty(tmp_path):
    write_points(tmp_path)
    reader = SummaryReader(tmp_path)
    for query in (reader.scalars, reader.count, reader.histograms, reader.samples, reader.texts):
        with pytest.raises(TypeError, match="name"):
            query(5)
    assert reader.count("loss") == 40


def test_max_points_and_level_arguments(tmp_path):
    write_points(tmp_path)
    reader = SummaryReader(tmp_path)
    with pytest.raises(TypeError, match="max_points"):  # TypeError since issue 16 (was ValueError)
        reader.scalars("loss", max_points=True)  # a bool is not a point count
    assert len(reader.scalars("loss", max_points=np.int64(1000))) == 40  # NumPy ints are counts
    # "0" read every file again into a separate cache; a wrong type: TypeError since issue 16 (was ValueError)
    for level, error in (("0", TypeError), (-1, ValueError), (9, ValueError)):
        with pytest.raises(error, match="level"):
            reader.refresh(level)
    assert reader.count("loss") == 40


def test_logdir_that_is_a_file_raises(tmp_path):
    path = tmp_path / "not_a_dir"
    path.write_text("x")
    with pytest.raises(NotADirectoryError, match="logdir"):
        SummaryReader(path)
    assert SummaryReader(tmp_path / "not_yet_written").names() == []  # a future logdir is fine


def test_foreign_file_is_skipped_with_skip_and_named_with_raise(tmp_path):
    write_points(tmp_path)
    (tmp_path / "zz-foreign.level0.summaries").write_bytes(b"NOTCARLS" + bytes(24))
    (tmp_path / "a-directory.level0.summaries").mkdir()  # was IsADirectoryError
    with pytest.raises(ValueError, match="zz-foreign"):
        SummaryReader(tmp_path).names()
    reader = SummaryReader(tmp_path, on_corrupt="skip")
    assert reader.names() == ["loss"] and reader.count("loss") == 40
    assert reader.corrupt_records == 1
    reader.refresh()
    assert reader.corrupt_records == 1  # counted once, not on every refresh
