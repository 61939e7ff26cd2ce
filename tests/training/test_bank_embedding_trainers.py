"""Two trainers on one bank table: the lazy update combines their gradients as the rule in
``carlskit.bank`` says (averaged, or summed with ``combine="sum"``), computed here by hand; immediate
SGD (max_pending=1) applies each on arrival, which SGD's summed lazy update equals."""

import threading

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from carlskit import KnowledgeBank
from carlskit.training import BankEmbedding, BankEmbeddings, Trainer


class Rows(nnx.Module):
    def __init__(self):
        self.embed = BankEmbedding("t", 2)


def weighted_sum(model, batch):
    """loss = sum_i <row(ids_i), c_i>: the gradient of a row is the sum of c_i over its uses."""
    return jnp.sum(model.embed(batch, "ids") * batch["c"]), {}


class BothLookedUp(BankEmbeddings):
    """The real stage, holding each batch until both trainers have looked theirs up, so both
    gradients reach the bank before either trainer's next lookup (the case the lazy rule averages)."""

    def __init__(self, bank, barrier):
        super().__init__(bank, {"t": ["ids"]}, max_staleness=0)
        self.barrier = barrier

    def __call__(self, batch):
        out = super().__call__(batch)
        self.barrier.wait(timeout=30)
        return out


BATCH_A = {"ids": np.array([0, 0, 1]), "c": np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], np.float32)}
BATCH_B = {"ids": np.array([0, 2]), "c": np.array([[-2.0, 0.0], [1.0, 1.0]], np.float32)}


@pytest.mark.parametrize("max_pending, combine, expected", [
    # lazy: key 0 got g_A = [1+3, 2+4] = [4, 6] and g_B = [-2, 0], averaged: [1, 3]; v = 0 - 0.5 * [1, 3]
    (16, "mean", {0: [-0.5, -1.5], 1: [-2.5, -3.0], 2: [-0.5, -0.5]}),
    # lazy summed: g = [4, 6] + [-2, 0] = [2, 6] in one step; v = 0 - 0.5 * [2, 6]
    (16, "sum", {0: [-1.0, -3.0], 1: [-2.5, -3.0], 2: [-0.5, -0.5]}),
    # immediate SGD: each gradient applied when it arrives: v = 0 - 0.5 * [4, 6] - 0.5 * [-2, 0]
    (1, "mean", {0: [-1.0, -3.0], 1: [-2.5, -3.0], 2: [-0.5, -0.5]}),
])
def test_two_trainers_lazy_rule_matches_it_by_hand(max_pending, combine, expected):
    bank = KnowledgeBank()
    bank.create_table("t", 2, initializer="zeros", learning_rate=0.5, max_pending=max_pending,
                      pending_ttl_seconds=float("inf"), combine=combine)
    barrier = threading.Barrier(2)
    trainers = [Trainer(Rows(), optax.sgd(0.0), weighted_sum, knowledge=BothLookedUp(bank, barrier))
                for _ in range(2)]
    handles = [t.fit([batch], 1, block=False, progress=False, live=False)
               for t, batch in zip(trainers, (BATCH_A, BATCH_B))]
    for handle in handles:
        handle.wait(timeout=60)
    stats = bank.stats()["tables"]["t"]
    assert stats["gradients_received"] == 4
    assert stats["pending_gradients"] == (4 if max_pending > 1 else 0)  # cached until the next lookup
    values, found = bank.lookup("t", np.array([0, 1, 2]))  # the lookup applies the cached gradients
    assert found.all()
    np.testing.assert_allclose(values, [expected[k] for k in range(3)])
    assert bank.stats()["tables"]["t"]["optimizer_steps"] == (3 if max_pending > 1 else 4)
