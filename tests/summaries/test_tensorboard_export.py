"""TensorBoard export: read back with TensorBoard's own reader, every value compared."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator  # TensorBoard's own reader (dev extra)

from carlskit.summaries import SummaryReader, SummaryWriter
from carlskit.summaries.__main__ import main

REPO_ROOT = Path(__file__).resolve().parents[2]
ALL = {event_accumulator.SCALARS: 0, event_accumulator.HISTOGRAMS: 0, event_accumulator.TENSORS: 0}


def write_summaries(logdir: Path) -> None:
    rng = np.random.default_rng(0)
    with SummaryWriter(logdir, flush_every_seconds=60) as writer:
        for step in range(300):  # two names whose steps interleave in no particular file order
            writer.scalar("train/loss", 1.0 / 3.0 + step * 1e-7, step)  # not exact in float32
            if step % 3 == 0:
                writer.scalar("eval/accuracy", float(rng.random()), step)
        writer.scalar("train/loss", float("inf"), 300)
        writer.flush()
        for step in (0, 50, 100):
            writer.array("params/w", rng.normal(step, 1.0, 1_000), step, bins=7)
            writer.array("params/sampled", rng.normal(0.0, 1.0, 100), step, mode="samples", max_samples=20)
            writer.text("notes", f"step {step}: héllo ✓", step)


def accumulate(logdir: Path):
    accumulator = event_accumulator.EventAccumulator(str(logdir), size_guidance=ALL)
    accumulator.Reload()
    return accumulator


def test_every_scalar_histogram_and_text_reads_back_in_tensorboard(tmp_path):
    write_summaries(tmp_path / "run")
    reader = SummaryReader(tmp_path / "run")
    result = reader.to_tensorboard(tmp_path / "tb")
    assert (result["scalars"], result["histograms"], result["samples"], result["texts"]) == (401, 3, 3, 3)
    assert Path(result["path"]).parent == tmp_path / "tb"
    board = accumulate(tmp_path / "tb")
    tags = board.Tags()
    assert sorted(tags["scalars"]) == ["eval/accuracy", "train/loss"]
    assert sorted(tags["histograms"]) == ["params/sampled", "params/w"]
    assert tags["tensors"] == ["notes"]

    for name in ("train/loss", "eval/accuracy"):
        frame = reader.scalars(name)
        events = board.Scalars(name)
        assert [event.step for event in events] == frame["step"].tolist()
        assert [event.wall_time for event in events] == frame["wall_time"].tolist()  # float64, exact
        np.testing.assert_array_equal(np.array([event.value for event in events], dtype=np.float32),
                                      frame["value"].to_numpy().astype(np.float32))

    frame = reader.histograms("params/w")
    events = board.Histograms("params/w")
    assert [event.step for event in events] == frame["step"].tolist() == [0, 50, 100]
    assert [event.wall_time for event in events] == frame["wall_time"].tolist()
    for event, edges, counts in zip(events, frame["edges"], frame["counts"]):
        histogram = event.histogram_value
        assert list(histogram.bucket) == counts.tolist() and sum(histogram.bucket) == 1_000
        assert list(histogram.bucket_limit) == edges[1:].tolist()
        assert (histogram.min, histogram.max, histogram.num) == (edges[0], edges[-1], 1_000)
    assert [sum(event.histogram_value.bucket) for event in board.Histograms("params/sampled")] == [20] * 3

    frame = reader.texts("notes")
    events = board.Tensors("notes")
    assert [event.step for event in events] == frame["step"].tolist()
    assert [event.wall_time for event in events] == frame["wall_time"].tolist()
    assert [event.tensor_proto.string_val[0].decode("utf-8") for event in events] == frame["text"].tolist()
    assert board.SummaryMetadata("notes").plugin_data.plugin_name == "text"


def test_export_command_writes_event_files_and_reports_counts(tmp_path):
    write_summaries(tmp_path / "run")
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    done = subprocess.run([sys.executable, "-m", "carlskit.summaries", "export", str(tmp_path / "run"),
                           str(tmp_path / "tb")], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["scalars"] == 401 and report["texts"] == 3
    assert len(accumulate(tmp_path / "tb").Scalars("train/loss")) == 301


def test_export_command_usage_errors_and_corrupt_files(tmp_path, capsys):
    with pytest.raises(SystemExit) as caught:
        main(["export", str(tmp_path / "missing"), str(tmp_path / "tb")])
    assert caught.value.code == 2 and "missing" in capsys.readouterr().err
    write_summaries(tmp_path / "run")
    (path,) = (tmp_path / "run").glob("*.level0.summaries")
    data = bytearray(path.read_bytes())
    data[40] ^= 0xFF
    path.write_bytes(bytes(data))
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "tb")]) == 1
    assert path.name in capsys.readouterr().err
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "tb"), "--on-corrupt", "skip"]) == 0
    assert json.loads(capsys.readouterr().out)["corrupt_records_skipped"] == 1
    with pytest.raises(ValueError, match="logdir"):
        SummaryReader(tmp_path / "run").to_tensorboard(tmp_path / "run")
