"""SummaryWriter and SummaryReader in one process and across processes (no cluster)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest
from process_helpers import wait_until

from carlskit.summaries import SummaryReader, SummaryWriter, aggregator_of

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def python_process(code: str, *args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


WRITER = """
    import sys, time
    from carlskit.summaries import SummaryWriter
    logdir, batches, points = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    with SummaryWriter(logdir, flush_every_seconds=0.05) as writer:
        for batch in range(batches):
            if batch == batches // 2:  # pause half-way until the test has seen both readers read
                writer.flush()
                print("half", flush=True)
                assert sys.stdin.readline().strip() == "go"
            for index in range(points):
                step = batch * points + index
                writer.scalar("train/loss", (step % 97) / 7.0 - 3.0, step)
                writer.scalar("train/lr", 1e-3 * 0.999**step, step)
            writer.text("notes", f"batch {batch} done", batch)
            time.sleep(0.02)
    print("written")
"""

READER = """
    import sys, time
    import numpy as np
    from carlskit.summaries import SummaryReader
    logdir, half, total = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    reader = SummaryReader(logdir)
    seen, refreshes, deadline = 0, 0, time.monotonic() + 60
    while seen < half and time.monotonic() < deadline:  # the writer is paused at half
        seen = len(reader.scalars("train/loss"))
        time.sleep(0.01)
    print("mid", seen, flush=True)  # read while the writer is still running
    while seen < total and time.monotonic() < deadline:
        seen = len(reader.scalars("train/loss"))  # incremental: only new bytes are read
        refreshes += 1
        time.sleep(0.01)
    frame = reader.scalars("train/loss")
    steps = np.arange(total)
    assert np.array_equal(frame["step"].to_numpy(), steps), "steps differ"
    assert np.array_equal(frame["value"].to_numpy(), (steps % 97) / 7.0 - 3.0), "values differ"
    lr = reader.scalars("train/lr")["value"].to_numpy()
    assert np.array_equal(lr, np.array([1e-3 * 0.999**int(s) for s in steps])), "lr differs"
    print("ok", refreshes)
"""


def test_writer_and_readers_in_separate_processes_read_back_everything_exactly(tmp_path):
    batches, points = 40, 250
    total = batches * points
    half = batches // 2 * points
    # Synchronised by events, not by timing: the writer pauses half-way (flushed) until both
    # readers have read exactly that half, so they read a log that is still being written.
    writer = python_process(WRITER, str(tmp_path), str(batches), str(points))
    readers = [python_process(READER, str(tmp_path), str(half), str(total)) for _ in range(2)]
    try:
        assert writer.stdout.readline().strip() == "half", writer.stderr.read()
        assert [reader.stdout.readline().split() for reader in readers] == [["mid", str(half)]] * 2
        assert writer.poll() is None  # still running, paused
        writer.stdin.write("go\n")
        writer.stdin.flush()
        outputs = [process.communicate(timeout=90) for process in [writer, *readers]]
    finally:
        for process in [writer, *readers]:
            if process.poll() is None:
                process.kill()
                process.wait()
    for process, (out, err) in zip([writer, *readers], outputs):
        assert process.returncode == 0, err
    refreshes = [int(out.split()[1]) for out, _ in outputs[1:]]
    assert all(count >= 1 for count in refreshes), "readers should have read the second half incrementally"
    texts = SummaryReader(tmp_path).texts("notes")
    assert texts["text"].tolist() == [f"batch {batch} done" for batch in range(batches)]


def test_sample_rate_keeps_about_that_fraction_with_a_fixed_seed(tmp_path):
    calls, rate = 20_000, 0.1
    with SummaryWriter(tmp_path / "a", sample_rate=rate, seed=7) as writer:
        kept = sum(writer.scalar("x", step, step) for step in range(calls))
    sigma = np.sqrt(calls * rate * (1 - rate))
    assert abs(kept - calls * rate) < 5 * sigma
    frame = SummaryReader(tmp_path / "a").scalars("x")
    assert len(frame) == kept
    with SummaryWriter(tmp_path / "b", sample_rate=rate, seed=7) as writer:  # same seed, same draws
        for step in range(calls):
            writer.scalar("x", step, step)
    np.testing.assert_array_equal(SummaryReader(tmp_path / "b").scalars("x")["step"], frame["step"])


def test_per_call_sample_rate_overrides_the_writer_default(tmp_path):
    with SummaryWriter(tmp_path, sample_rate=0.0) as writer:
        assert not writer.scalar("dropped", 1.0, 0)
        assert writer.scalar("kept", 1.0, 0, sample_rate=1.0)
        assert writer.scalars("batched", np.ones(1000), np.arange(1000), sample_rate=1.0) == 1000
    reader = SummaryReader(tmp_path)
    assert reader.names() == ["batched", "kept"]


def test_arrays_texts_and_batched_scalars_round_trip(tmp_path):
    values = np.random.default_rng(0).normal(size=(40, 50))
    with SummaryWriter(tmp_path) as writer:
        writer.array("weights", values, 3, bins=10)
        writer.array("weights_sample", values, 3, mode="samples", max_samples=64)
        writer.array("small_sample", np.arange(5.0), 4, mode="samples")
        writer.text("config", "lr=0.1 ✓", 0)
        writer.scalars("fast", np.linspace(0, 1, 5000), np.arange(5000))
    reader = SummaryReader(tmp_path)
    assert reader.names("scalars") == ["fast"]
    histogram = reader.histograms("weights").iloc[0]
    counts, edges = np.histogram(values, bins=10)
    np.testing.assert_array_equal(histogram["counts"], counts)
    np.testing.assert_allclose(histogram["edges"], edges)
    sample = reader.samples("weights_sample").iloc[0]
    assert sample["original_size"] == values.size and sample["values"].size == 64
    assert np.isin(sample["values"], values).all()
    np.testing.assert_array_equal(reader.samples("small_sample").iloc[0]["values"], np.arange(5.0))
    assert reader.texts("config")["text"].tolist() == ["lr=0.1 ✓"]
    np.testing.assert_array_equal(reader.scalars("fast")["value"], np.linspace(0, 1, 5000))


def test_subsampled_copies_hold_every_sixteenth_point(tmp_path):
    points = 100_000
    with SummaryWriter(tmp_path, flush_every_seconds=60) as writer:
        for start in range(0, points, 7_000):  # batches that do not align with the stride
            steps = np.arange(start, min(start + 7_000, points))
            writer.scalars("loss", np.sqrt(steps), steps)
            writer.flush()
    reader = SummaryReader(tmp_path)
    coarse = reader.scalars("loss", max_points=1_000)
    np.testing.assert_array_equal(coarse["step"], np.arange(0, points, 256))
    np.testing.assert_array_equal(coarse["value"], np.sqrt(np.arange(0, points, 256)))
    assert len(reader.scalars("loss", max_points=10_000)) == len(range(0, points, 16))
    assert len(reader.scalars("loss", max_points=10**7)) == points


def test_reader_sees_new_points_incrementally(tmp_path):
    reader = SummaryReader(tmp_path)
    assert reader.names() == [] and reader.scalars("loss").empty
    with SummaryWriter(tmp_path, flush_every_seconds=60) as writer:
        for round_ in range(3):
            for step in range(round_ * 10, round_ * 10 + 10):
                writer.scalar("loss", step, step)
            writer.flush()
            assert reader.count("loss") == (round_ + 1) * 10
    np.testing.assert_array_equal(reader.scalars("loss")["value"], np.arange(30.0))


def test_background_thread_flushes_without_explicit_flush(tmp_path):
    writer = SummaryWriter(tmp_path, flush_every_seconds=0.05)
    writer.scalar("loss", 1.0, 0)
    reader = SummaryReader(tmp_path)
    wait_until(lambda: reader.count("loss") > 0, seconds=120)  # a 4 s window raced a loaded machine (issue 43)
    assert reader.count("loss") == 1
    writer.close()
    writer.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        writer.scalar("loss", 1.0, 1)


def test_pickled_writer_without_client_writes_its_own_files(tmp_path):
    with SummaryWriter(tmp_path) as writer:
        writer.scalar("a", 1.0, 0)
        copy = pickle.loads(pickle.dumps(writer))
        with copy:
            copy.scalar("a", 2.0, 1)
    assert len(list(tmp_path.glob("*.level0.summaries"))) == 2
    np.testing.assert_array_equal(SummaryReader(tmp_path).scalars("a")["value"], [1.0, 2.0])


def test_bad_input_names_the_argument(tmp_path):
    with pytest.raises(ValueError, match="sample_rate"):
        SummaryWriter(tmp_path, sample_rate=1.5)
    with pytest.raises(ValueError, match="flush_every_seconds"):
        SummaryWriter(tmp_path, flush_every_seconds=0)
    with SummaryWriter(tmp_path) as writer:
        with pytest.raises(TypeError, match="value must be a number"):
            writer.scalar("loss", "high", 0)
        with pytest.raises(TypeError, match="name"):
            writer.scalar("", 1.0, 0)
        with pytest.raises(ValueError, match="steps must be integers"):
            writer.scalars("loss", np.ones(3), np.ones(3))
        with pytest.raises(ValueError, match="mode"):
            writer.array("w", np.ones(3), 0, mode="image")
        with pytest.raises(TypeError, match="text"):
            writer.text("t", 3, 0)
    assert SummaryReader(tmp_path).names() == []


def test_shard_of_is_crc32_so_every_process_agrees():
    names = ["loss", "train/accuracy", "ünï"]
    # zlib.crc32 is a fixed function of the bytes (unlike hash(), salted per process by PYTHONHASHSEED)
    assert [aggregator_of(name, 7) for name in names] == [zlib.crc32(name.encode()) % 7 for name in names]
    assert [aggregator_of(name, 7) for name in names] == [1, 6, 6]


def test_a_bad_step_is_rejected_before_buffering_and_loses_no_other_summary(tmp_path):
    with SummaryWriter(tmp_path, flush_every_seconds=100) as writer:
        for step in range(5):
            writer.scalar("loss", float(step), step)
        writer.array("weights", np.ones(3), 0)
        for call in (lambda: writer.array("weights", np.ones(3), step="x"),
                     lambda: writer.array("other", np.ones(3), step=None, mode="samples"),
                     lambda: writer.text("note", "hello", step="x")):
            with pytest.raises(TypeError, match="step must be an int"):
                call()
        writer.text("note", "kept", 1)
        writer.flush()  # must not fail on the rejected calls
    reader = SummaryReader(tmp_path)
    np.testing.assert_array_equal(reader.scalars("loss")["step"], np.arange(5))
    assert list(reader.histograms("weights")["step"]) == [0]
    assert list(reader.texts("note")["text"]) == ["kept"] and "other" not in reader.names()
