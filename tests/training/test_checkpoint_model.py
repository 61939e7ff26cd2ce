"""Model-based test of the checkpoint store (Hypothesis stateful testing, in-process): random saves
(newer, or stale versions that must be refused), bit flips in a random published file, and stores
reopened from the directory; after every step the store agrees with a model holding each saved
version's arrays and whether a flip damaged it: ``latest()`` is the newest intact version,
``load_latest()`` returns its arrays, every published intact version loads exactly, every damaged
one raises ``CorruptFileError``.
"""

from __future__ import annotations

import pathlib
import shutil
import tempfile

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, seed, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from carlskit._errors import CorruptFileError
from carlskit.training import CheckpointStore


class CheckpointMachine(RuleBasedStateMachine):
    steps = 0
    counts = {"saves": 0, "stale_refused": 0, "bits_flipped": 0, "reopens": 0}

    def __init__(self) -> None:
        super().__init__()
        self.directory = tempfile.mkdtemp(prefix="carlskit-checkpoint-model-")
        self.store = CheckpointStore(self.directory, keep=3)
        self.saved: dict[int, np.ndarray] = {}  # version -> its "w"
        self.damaged: set[int] = set()
        self.pristine: dict[tuple[int, str], bytes] = {}  # a flipped file's bytes as saved

    def teardown(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    def newest_intact(self) -> int | None:
        intact = [v for v in self.saved if v not in self.damaged]
        return max(intact) if intact else None

    @rule(gap=st.integers(1, 3), values=st.lists(st.floats(-1e3, 1e3, width=32), min_size=1, max_size=4))
    def save_newer(self, gap, values):
        type(self).steps += 1
        newest = max(self.saved, default=-1)
        version = newest + gap
        w = np.array(values, np.float32)
        assert self.store.save({"w": w}, version=version, metadata={"n": len(values)}) == version
        type(self).counts["saves"] += 1
        self.saved[version] = w
        self.damaged.discard(version)
        self.pristine = {key: data for key, data in self.pristine.items() if key[0] != version}

    @precondition(lambda self: self.newest_intact() is not None)
    @rule(back=st.integers(0, 2))
    def save_stale_is_refused(self, back):
        type(self).steps += 1
        version = self.newest_intact() - back
        before = sorted(pathlib.Path(self.directory).iterdir())
        with pytest.raises(ValueError, match="version"):
            self.store.save({"w": np.zeros(1, np.float32)}, version=version)
        assert sorted(pathlib.Path(self.directory).iterdir()) == before
        type(self).counts["stale_refused"] += 1

    @precondition(lambda self: self.saved)
    @rule(data=st.data(), which=st.sampled_from(["json", "npz"]))
    def flip_a_bit(self, data, which):
        type(self).steps += 1
        published = self.store.versions()
        if not published:
            return
        version = data.draw(st.sampled_from(published), "version")
        file = pathlib.Path(self.store.file(version, which))
        content = bytearray(file.read_bytes())
        at = data.draw(st.integers(0, 2**20), "byte") % len(content)  # lengths vary (wall times)
        content[at] ^= 1 << data.draw(st.integers(0, 7), "bit")
        self.pristine.setdefault((version, which), file.read_bytes())
        file.write_bytes(bytes(content))
        # damaged unless every flipped file is back to its saved bytes (the same bit flipped twice)
        if any(pathlib.Path(self.store.file(v, w)).read_bytes() != data
               for (v, w), data in self.pristine.items() if v == version):
            self.damaged.add(version)
        else:
            self.damaged.discard(version)
        type(self).counts["bits_flipped"] += 1

    @rule()
    def reopen(self):
        type(self).steps += 1
        self.store = CheckpointStore(self.directory, keep=3)
        type(self).counts["reopens"] += 1

    @invariant()
    def agrees_with_the_model(self):
        newest = self.newest_intact()
        # latest() hashes a version's arrays once per store object (documented): a flip in an .npz
        # after that is seen by a fresh store, and by every load
        assert CheckpointStore(self.directory, keep=3).latest() == newest
        found = self.store.load_latest()
        if newest is None:
            assert found is None
        else:
            version, tree, metadata = found
            assert version == newest and metadata["n"] == len(self.saved[newest])
            np.testing.assert_array_equal(tree["['w']"], self.saved[newest])
        for version in self.store.versions():
            assert version in self.saved
            if version in self.damaged:
                with pytest.raises(CorruptFileError):
                    self.store.load(version)
            else:
                tree, _ = self.store.load(version)
                np.testing.assert_array_equal(tree["['w']"], self.saved[version])


# A chosen seed, not one derived from this file's source (derandomize=True: a one-line edit draws
# another run; issue 43). The counts this seed reaches are printed every run and asserted below with a
# margin, so the test fails if a run stops exercising what it claims (damaged files, refused saves).
SEED = 43


@seed(SEED)
class SeededCheckpointMachine(CheckpointMachine):
    """The checkpoint machine from a chosen seed."""


def test_checkpoint_store_matches_the_model():
    run_state_machine_as_test(SeededCheckpointMachine, settings=settings(
        max_examples=30, stateful_step_count=25, deadline=None, database=None, derandomize=False,
        suppress_health_check=list(HealthCheck)))
    counts = CheckpointMachine.counts
    print("checkpoint model run:", SeededCheckpointMachine.steps, "steps", counts)
    # seed 43 reached 675 steps: 186 saves, 88 stale saves refused, 121 bits flipped, 280 reopens
    assert SeededCheckpointMachine.steps >= 300
    assert counts["saves"] >= 90 and counts["stale_refused"] >= 40 and counts["bits_flipped"] >= 60 \
        and counts["reopens"] >= 140, counts
