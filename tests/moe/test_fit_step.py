"""MoEModel.fit and the Trainer take the same training step (carlskit/_step.py), not two copies."""

import jax
import numpy as np
import optax
from flax import nnx

from carlskit.moe import MoEModel
from carlskit.training import Trainer

VOCAB, LENGTH, BATCH, STEPS, SEED = 16, 8, 4, 3, 5


def model():
    return MoEModel(VOCAB, 2, 16, 2, 4, max_length=LENGTH, second_expert_policy="random", seed=1)


def test_fit_and_the_trainer_give_the_same_losses_and_parameters():
    data = np.random.default_rng(0).integers(0, VOCAB, (16, LENGTH + 1)).astype(np.int32)
    fitted = model()
    history = fitted.fit(data, steps=STEPS, batch_size=BATCH, learning_rate=1e-2, seed=SEED)

    # The same batches and routing keys, as fit draws them, through the Trainer.
    rows = np.random.default_rng(SEED)
    routing_key = jax.random.key(SEED)

    def batch_at(step):
        return {"tokens": data[rows.integers(0, len(data), BATCH)], "rng": jax.random.fold_in(routing_key, step)}

    def loss_fn(m, batch):
        loss, metrics = m.loss_and_metrics(batch["tokens"], rng=batch["rng"])
        return loss, {"cross_entropy": metrics["cross_entropy"]}  # the Trainer logs scalar metrics only

    trained = model()
    records = Trainer(trained, optax.adam(1e-2), loss_fn).fit(batch_at, STEPS, progress=False, live=False)

    np.testing.assert_allclose([r["loss"] for r in records], history.column("loss"), rtol=1e-6)
    np.testing.assert_allclose([r["cross_entropy"] for r in records], history.column("cross_entropy"), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(nnx.state(fitted)), jax.tree.leaves(nnx.state(trained))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
