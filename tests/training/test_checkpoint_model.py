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
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from carlskit._errors import CorruptFileError
from carlskit.training import CheckpointStore


class CheckpointMachine(RuleBasedStateMachine):
    steps = 0

    def __init__(self) -> None:
        super().__init__()
        self.directory = tempfile.mkdtemp(prefix="carlskit-checkpoint-model-")
        self.store = CheckpointStore(self.directory, keep=3)
        self.saved: dict[int, np.ndarray] = {}  # version -> its "w"
        self.damaged: set[int] = set()

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
        self.saved[version] = w
        self.damaged.discard(version)

    @precondition(lambda self: self.newest_intact() is not None)
    @rule(back=st.integers(0, 2))
    def save_stale_is_refused(self, back):
        type(self).steps += 1
        version = self.newest_intact() - back
        before = sorted(pathlib.Path(self.directory).iterdir())
        with pytest.raises(ValueError, match="version"):
            self.store.save({"w": np.zeros(1, np.float32)}, version=version)
        assert sorted(pathlib.Path(self.directory).iterdir()) == before

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
        file.write_bytes(bytes(content))
        self.damaged.add(version)

    @rule()
    def reopen(self):
        type(self).steps += 1
        self.store = CheckpointStore(self.directory, keep=3)

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


def test_checkpoint_store_matches_the_model():
    run_state_machine_as_test(CheckpointMachine, settings=settings(
        max_examples=30, stateful_step_count=25, deadline=None, database=None, derandomize=True,
        suppress_health_check=list(HealthCheck)))
    assert CheckpointMachine.steps >= 300
