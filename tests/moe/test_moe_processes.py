"""MoEModel with its expert axis across two processes (run_spmd, gloo on CPU): the dispatch's
all-to-all crosses the process boundary, and loss, routing, gradients and training equal the
one-process 8-device run and the one-device run."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from process_helpers import checkout_cluster

from carlskit.cluster import run_spmd

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
import spmd_functions  # noqa: E402

pytestmark = pytest.mark.slow


def test_two_processes_of_four_devices_equal_one_process_of_eight_and_one_device():
    with checkout_cluster(2) as client:
        runs = {(p, d): run_spmd(client, spmd_functions.moe_forward_and_training, processes=p, devices_per_process=d,
                                 output=False)
                for p, d in ((2, 4), (1, 8), (1, 1))}
    group, eight, one = runs[(2, 4)], runs[(1, 8)][0], runs[(1, 1)][0]
    assert [r["processes"] for r in group] == [2, 2] and group[0]["devices"] == 8
    assert group[0]["all_to_all"] >= 2  # dispatch and combine cross the processes
    for rank in group:  # every rank sees the same replicated results
        for other in (eight, one):
            assert rank["loss"] == pytest.approx(other["loss"], abs=1e-5)
            np.testing.assert_array_equal(rank["expert_load"], other["expert_load"])  # the same routing
            assert rank["dropped"] == other["dropped"]
            assert rank["grad_norm"] == pytest.approx(other["grad_norm"], rel=1e-5)
            np.testing.assert_allclose(rank["training"], other["training"], rtol=1e-5)
