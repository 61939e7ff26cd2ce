"""SummaryWriter under failure, in one process: bad steps and sizes are refused where they enter,
background errors surface at the next call with nothing lost, and a batch written twice (an
aggregator that died before acknowledging) is read once."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from carlskit.summaries import SummaryReader, SummaryWriter, _format
from carlskit.summaries._files import SummaryFiles
from carlskit.summaries._writer import MAX_BINS, SummaryAggregator, SummaryAggregatorError

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

BAD_STEPS = [
    (2**63, ValueError),  # one past int64: was accepted, and the next flush dropped every pending point
    (-(2**63) - 1, ValueError),
    (np.uint64(2**63), ValueError),
    ("5", TypeError),
    (1.7, TypeError),  # was logged as step 1
    (5.0, TypeError),
    (np.float32(2.0), TypeError),
    (True, TypeError),
    (None, TypeError),
]


@pytest.mark.parametrize(("step", "error"), BAD_STEPS, ids=[repr(step) for step, _ in BAD_STEPS])
def test_a_bad_step_is_refused_by_every_call_and_no_pending_point_is_lost(tmp_path, step, error):
    with SummaryWriter(tmp_path, flush_every_seconds=100) as writer:
        writer.scalar("loss", 1.0, 0)
        writer.text("note", "before", 0)
        calls = [lambda: writer.scalar("loss", 2.0, step),
                 lambda: writer.array("weights", np.ones(3), step),
                 lambda: writer.array("weights", np.ones(3), step, mode="samples"),
                 lambda: writer.text("note", "bad", step)]
        for call in calls:
            with pytest.raises(error, match="step"):
                call()
        writer.scalar("loss", 3.0, np.int64(2**63 - 1))  # numpy ints up to int64's maximum are steps
        writer.flush()
    reader = SummaryReader(tmp_path)
    assert reader.scalars("loss")["step"].tolist() == [0, 2**63 - 1]
    assert reader.scalars("loss")["value"].tolist() == [1.0, 3.0]
    assert reader.texts("note")["text"].tolist() == ["before"]
    assert "weights" not in reader.names()


def test_batched_steps_must_be_int64_integers(tmp_path):
    with SummaryWriter(tmp_path, flush_every_seconds=100) as writer:
        writer.scalars("loss", [1.0, 2.0], [0, 1])
        with pytest.raises(ValueError, match="steps"):
            writer.scalars("loss", [1.0], np.array([2**63], dtype=np.uint64))
        with pytest.raises(ValueError, match="steps"):
            writer.scalars("loss", [1.0], np.array([True]))
        with pytest.raises(TypeError, match="values"):
            writer.scalars("loss", ["5"], [2])
    assert SummaryReader(tmp_path).scalars("loss")["step"].tolist() == [0, 1]


@pytest.mark.parametrize(("arguments", "name"), [
    ({"max_pending": 10**12}, "max_pending"),
    ({"max_pending": 0}, "max_pending"),
    ({"n_shards": 10**9}, "n_shards"),
    ({"block_seconds": -1.0}, "block_seconds"),
    ({"restart_policy": -5.0}, "restart_policy"),
    ({"flush_every_seconds": float("nan")}, "flush_every_seconds"),
])
def test_huge_or_bad_size_arguments_are_a_clear_value_error(tmp_path, arguments, name):
    with pytest.raises(ValueError, match=name):
        SummaryWriter(tmp_path, **arguments)


def test_huge_bins_or_samples_are_a_clear_value_error_not_a_memory_error(tmp_path):
    with SummaryWriter(tmp_path) as writer:
        with pytest.raises(ValueError, match="bins"):
            writer.array("w", np.ones(3), 0, bins=10**12)
        with pytest.raises(ValueError, match="max_samples"):
            writer.array("w", np.ones(3), 0, mode="samples", max_samples=10**12)
        with pytest.raises(TypeError, match="bins"):
            writer.array("w", np.ones(3), 0, bins=2.5)
        writer.array("w", np.arange(10.0), 0, bins=MAX_BINS)
    assert len(SummaryReader(tmp_path).histograms("w")["counts"][0]) == MAX_BINS


def test_a_background_error_is_raised_by_the_next_call_and_its_points_are_kept(tmp_path):
    logdir = tmp_path / "logs"
    writer = SummaryWriter(logdir, flush_every_seconds=0.02)
    shutil.rmtree(logdir)  # the files cannot be created: every background flush fails
    writer.scalar("loss", 1.0, 0)
    with pytest.raises(FileNotFoundError):
        for step in range(1, 10_000):
            writer.scalar("loss", float(step), step)  # the next call after the failure raises it
            if step % 100 == 0:
                writer._stop.wait(0.01)
    logged = step  # points 0 .. step - 1 were accepted; the raising call logged nothing
    logdir.mkdir()
    writer.close()  # the held batches are written now
    frame = SummaryReader(logdir).scalars("loss")
    assert frame["step"].tolist() == list(range(logged))


def test_flush_raises_an_error_instead_of_waiting_for_the_thread(tmp_path):
    logdir = tmp_path / "logs"
    writer = SummaryWriter(logdir, flush_every_seconds=100)
    writer.scalar("loss", 1.0, 0)
    shutil.rmtree(logdir)
    with pytest.raises(FileNotFoundError):
        writer.flush()
    logdir.mkdir()
    writer.close()
    assert SummaryReader(logdir).scalars("loss")["step"].tolist() == [0]


def scalar_batch(name: str, steps) -> tuple:
    steps = np.asarray(steps, dtype=np.int64)
    return (_format.SCALARS, name, steps.size, [steps, steps * 0.5, steps * 2.0])


def test_a_batch_written_twice_by_a_dying_and_a_new_aggregator_is_read_once(tmp_path):
    """What a SIGKILL between the write and the acknowledgement leaves: the batch is in the dead
    aggregator's file, the writer re-sends it (with the batches after it) to the replacement."""
    writer_id = 12345
    dying = SummaryAggregator(str(tmp_path), 0)
    assert dying.append(writer_id, [(0, [scalar_batch("loss", range(0, 10))]),
                                    (1, [scalar_batch("loss", range(10, 20))])]) == 1
    dying.close()  # ... its acknowledgement never reached the writer
    replacement = SummaryAggregator(str(tmp_path), 0)
    sends = [(0, [scalar_batch("loss", range(0, 10))]), (1, [scalar_batch("loss", range(10, 20))]),
             (2, [scalar_batch("loss", range(20, 30))])]
    assert replacement.append(writer_id, sends) == 2
    assert replacement.append(writer_id, sends) == 2  # a repeated call writes nothing again
    replacement.close()
    reader = SummaryReader(tmp_path)
    frame = reader.scalars("loss")
    assert frame["step"].tolist() == list(range(30))
    assert frame["value"].tolist() == [step * 2.0 for step in range(30)]
    assert reader.duplicate_records == 2
    # other writers' batches with the same sequence numbers are different batches
    other = SummaryFiles(tmp_path, "other-writer")
    other.append([scalar_batch("loss", [30])], writer_id=999, sequence=0)
    other.close()
    assert reader.scalars("loss")["step"].tolist() == list(range(31))


def test_an_aggregators_own_failure_is_its_own_error_type(tmp_path):
    logdir = tmp_path / "logs"
    aggregator = SummaryAggregator(str(logdir), 0)
    shutil.rmtree(logdir)
    with pytest.raises(SummaryAggregatorError, match="shard 0"):
        aggregator.append(1, [(0, [scalar_batch("loss", [0])])])
    logdir.mkdir()
    assert aggregator.append(1, [(0, [scalar_batch("loss", [0])])]) == 0  # the re-send is written
    aggregator.close()
    assert SummaryReader(logdir).scalars("loss")["step"].tolist() == [0]


def test_integer_steps_of_every_kind_are_accepted(tmp_path):
    import jax.numpy as jnp

    with SummaryWriter(tmp_path) as writer:
        for step in (0, np.int32(1), np.uint64(2), np.array(3), jnp.int32(4), -(2**63)):
            writer.scalar("loss", 1.0, step)
        writer.scalar("loss", np.float32(0.5), 5)  # values may be any real number, numpy's too
    assert SummaryReader(tmp_path).scalars("loss")["step"].tolist() == [-(2**63), 0, 1, 2, 3, 4, 5]
