"""Model-based test of the summary writer (Hypothesis stateful testing), smaller than the bank's:
random ``scalar`` / ``scalars`` / ``text`` logging to names on both aggregators, ``flush``, and
SIGKILL of a random aggregator's worker. After every flush (the writer's acknowledgement) a fresh
``SummaryReader`` must read back every point logged so far exactly once, with its value: the model
is a dict of lists. Steps grow per name, as a training loop's do.

The run starts from a chosen seed, and a kill is forced after 12 steps without one (issue 43: a
seed derived from the source drew runs without kills after unrelated edits); the counts are
printed every run.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, seed, settings
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule, run_state_machine_as_test
from process_helpers import connected_cluster

from carlskit.cluster._supervised import RestartPolicy
from carlskit.summaries import SummaryReader, SummaryWriter, aggregator_of

pytestmark = pytest.mark.slow


def _names_on_both_shards(per_shard: int = 2) -> list[str]:
    names, counts, index = [], [0, 0], 0
    while min(counts) < per_shard:
        name = f"model/metric_{index}"
        if counts[aggregator_of(name, 2)] < per_shard:
            names.append(name)
            counts[aggregator_of(name, 2)] += 1
        index += 1
    return names


NAMES = _names_on_both_shards()
VALUES = st.sampled_from([-1.5, 0.0, 0.25, 3.0, 1e6])


class WriterMachine(RuleBasedStateMachine):
    client = None
    kills = forced_kills = steps = examples = 0
    force_kill_after_steps = 12  # whatever Hypothesis draws, every example kills an aggregator

    def __init__(self) -> None:
        super().__init__()
        self.directory = tempfile.mkdtemp(prefix="carlskit-writer-model-")
        policy = RestartPolicy(budget_seconds=120.0, initial_delay_seconds=0.1, max_delay_seconds=2.0)
        self.client.wait_for_workers(2, timeout=120)
        self.writer = SummaryWriter(self.directory, client=self.client, flush_every_seconds=0.05,
                                    restart_policy=policy)
        self.scalars_logged: dict[str, list[tuple[int, float]]] = {name: [] for name in NAMES}
        self.texts_logged: list[tuple[int, str]] = []
        self.since_kill = 0
        type(self).examples += 1

    def teardown(self) -> None:
        self.writer.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    def _next_step(self, name: str) -> int:
        logged = self.scalars_logged[name]
        return logged[-1][0] + 1 if logged else 0

    @rule(name=st.sampled_from(NAMES), value=VALUES)
    def scalar(self, name, value):
        self.step()
        step = self._next_step(name)
        assert self.writer.scalar(name, value, step)
        self.scalars_logged[name].append((step, value))

    @rule(name=st.sampled_from(NAMES), values=st.lists(VALUES, min_size=1, max_size=50))
    def scalars(self, name, values):
        self.step()
        first = self._next_step(name)
        steps = np.arange(first, first + len(values))
        assert self.writer.scalars(name, values, steps) == len(values)
        self.scalars_logged[name].extend(zip(steps.tolist(), values))

    @rule(text=st.text(st.characters(codec="utf-8"), max_size=20))
    def text(self, text):
        self.step()
        step = self.texts_logged[-1][0] + 1 if self.texts_logged else 0
        assert self.writer.text("model/notes", text, step)
        self.texts_logged.append((step, text))

    def step(self) -> None:
        type(self).steps += 1
        self.since_kill += 1
        if self.since_kill > self.force_kill_after_steps:
            type(self).forced_kills += 1
            self.kill_an_aggregator(type(self).kills % 2)

    @precondition(lambda self: self.since_kill >= 8)
    @rule(shard=st.integers(0, 1))
    def kill_an_aggregator(self, shard):
        type(self).steps += 1
        self.since_kill = 0
        self.client.wait_for_workers(2, timeout=120)
        address = self.writer._shards[shard].actor._address
        os.kill(self.client.run(os.getpid, workers=[address])[address], signal.SIGKILL)
        type(self).kills += 1
        # a worker SIGKILLed while its nanny is still starting it is never restarted (Dask)
        self.client.wait_for_workers(2, timeout=120)
        time.sleep(2.0)

    @rule()
    def flush_then_read_back(self):
        """Acknowledged: every point logged so far is read back exactly once."""
        self.step()
        self.writer.flush()
        reader = SummaryReader(self.directory)
        for name, logged in self.scalars_logged.items():
            frame = reader.scalars(name)
            assert frame["step"].tolist() == [step for step, _ in logged], name
            np.testing.assert_array_equal(frame["value"].to_numpy(), [value for _, value in logged])
        texts = reader.texts("model/notes") if self.texts_logged else None
        if texts is not None:
            assert texts["step"].tolist() == [step for step, _ in self.texts_logged]
            assert texts["text"].tolist() == [text for _, text in self.texts_logged]


@pytest.fixture(scope="module")
def client():
    with connected_cluster(2) as dask_client:
        yield dask_client


# Seed 3 was chosen by checking: with no forced kill it drew 2 kills in its 2 examples (50 steps), where
# seed 1 drew 0 kills and seed 2 two kills in 4 examples. The forced kills keep it killing after edits.
@seed(3)
class ShortRun(WriterMachine):
    """The writer machine from a chosen seed."""


def test_every_acknowledged_point_is_read_back_once_through_aggregator_kills(client):
    WriterMachine.client = client
    started = time.monotonic()
    run_state_machine_as_test(ShortRun, settings=settings(
        max_examples=2, stateful_step_count=25, deadline=None, database=None,
        suppress_health_check=list(HealthCheck)))
    print(f"writer model run: {ShortRun.steps} steps, {ShortRun.examples} examples, {ShortRun.kills} aggregator "
          f"kills ({ShortRun.forced_kills} forced), {time.monotonic() - started:.1f} s")
    assert ShortRun.steps >= 20 and ShortRun.kills >= ShortRun.examples
