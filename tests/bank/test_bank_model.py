"""Model-based tests of the bank (Hypothesis stateful testing): random sequences of create_table,
lookup(insert_missing=...), update, apply_gradients, flush, nearest, sample, snapshot (and on the
distributed bank SIGKILL of a random shard's worker, a write while it is lost, ``recover()``),
checked after every step against the plain-Python model of ``bank_model.py``.

``make test`` runs a short run of each from a chosen seed (seconds; the distributed one forces a kill
after every ``force_kill_after_steps`` steps without one); ``make soak`` the long one:
``CARLSKIT_SOAK_STEPS`` steps on the distributed bank (default 5000), a kill every
``CARLSKIT_SOAK_STEPS_BETWEEN_KILLS`` steps of an example at the earliest (default 50), figures printed as
JSON (and written to ``CARLSKIT_SOAK_REPORT`` if set); ``CARLSKIT_SOAK_DURABILITY`` the log's durability
(default ``process``).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from bank_model import DistributedBankMachine, EmbeddedBankMachine
from hypothesis import HealthCheck, seed, settings
from hypothesis.stateful import run_state_machine_as_test
from process_helpers import checkout_cluster

SOAK_STEPS = int(os.environ.get("CARLSKIT_SOAK_STEPS", "0"))
STEPS_PER_EXAMPLE = 100

# The short runs' seeds are chosen, not derived (issue 43): derandomize=True seeds Hypothesis from the
# machine's source, so a one-line edit of bank_model.py drew a run with 0 kills and the test failed.
# Each seed was checked to reach the counts asserted below (they are printed every run); the
# distributed run also forces a kill after 12 steps without one, so a later edit that changes what
# the seed draws still kills, recovers and half-applies a write in every example.
EMBEDDED_SEED = 43
DISTRIBUTED_SEED = 43


@seed(EMBEDDED_SEED)
class ShortEmbeddedRun(EmbeddedBankMachine):
    """The embedded machine from a chosen seed."""


@seed(DISTRIBUTED_SEED)
class ShortDistributedRun(DistributedBankMachine):
    """The distributed machine from a chosen seed, a kill allowed after 4 steps and forced after 12:
    Hypothesis may end an example after 10-20 steps, and every example must kill."""

    steps_between_kills = 4
    force_kill_after_steps = 12


def _settings(examples: int, steps: int, derandomize: bool) -> settings:
    return settings(max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
                    derandomize=derandomize, print_blob=True,
                    suppress_health_check=list(HealthCheck))


def test_embedded_bank_matches_the_model():
    run_state_machine_as_test(ShortEmbeddedRun, settings=_settings(25, 40, derandomize=False))
    print("embedded bank model run:", json.dumps(EmbeddedBankMachine.counts.as_dict()))
    assert EmbeddedBankMachine.counts.steps >= 500


@pytest.fixture(scope="module")
def client():
    with checkout_cluster(2) as dask_client:
        yield dask_client


@pytest.mark.slow
def test_distributed_bank_with_worker_kills_matches_the_model(client):
    DistributedBankMachine.client = client
    counts = DistributedBankMachine.counts
    diverged = True  # until the runs return: a failing check (or any error) is reported as one
    try:
        if SOAK_STEPS:  # independent runs of 20 examples (fresh seeds) until the steps are done
            DistributedBankMachine.steps_between_kills = int(
                os.environ.get("CARLSKIT_SOAK_STEPS_BETWEEN_KILLS", "50"))
            DistributedBankMachine.durability = os.environ.get("CARLSKIT_SOAK_DURABILITY", "process")
            while counts.steps < SOAK_STEPS:
                run_state_machine_as_test(DistributedBankMachine,
                                          settings=_settings(20, STEPS_PER_EXAMPLE, derandomize=False))
                print("bank model run so far:", json.dumps(counts.as_dict()), flush=True)
        else:
            run_state_machine_as_test(ShortDistributedRun, settings=_settings(3, 30, derandomize=False))
        diverged = False
    finally:
        report = {"machine": "distributed", "durability": DistributedBankMachine.durability,
                  "failed": diverged, **counts.as_dict()}
        print("bank model run:", json.dumps(report))
        if os.environ.get("CARLSKIT_SOAK_REPORT"):
            with open(os.environ["CARLSKIT_SOAK_REPORT"], "a") as handle:
                handle.write(json.dumps(report) + "\n")
    assert counts.kills >= counts.examples and counts.recoveries >= counts.kills  # every example killed
    assert counts.failed_writes >= 1  # a write half-applied while a shard was lost


def test_the_model_catches_a_bank_that_forgets_gradients():
    """The model is not vacuous: a bank whose flush drops the cached gradients diverges from it."""
    from bank_model import TABLES, TableModel

    model = TableModel(TABLES["sgd"])
    model.apply_gradients([1], np.array([[1.0, 1.0]], np.float32), 0.0)
    values, _ = model.lookup([1], False, 0.0)
    assert values.tolist() == [[-0.5, -0.5]]  # 0 - 0.5 * 1, not the 0 a forgetting bank would read
