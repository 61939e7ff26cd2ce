"""Small Flax models shared by tests (importable by Dask workers: ``tests/`` is on their path)."""

from flax import nnx


class Linear(nnx.Module):
    """``x [B, 4] -> [B]``: one dense layer, the smallest model a Trainer can fit."""

    def __init__(self, seed=0):
        self.linear = nnx.Linear(4, 1, rngs=nnx.Rngs(seed))

    def __call__(self, x):
        return self.linear(x)[:, 0]


def mse(model, batch):
    """Mean squared error of ``Linear`` on ``{"x", "y"}``, with no metrics: a Trainer's loss_fn."""
    import jax.numpy as jnp

    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2), {}


def sum_batch(step):
    """Batch ``step``: 8 rows of 4 normal features whose target is their sum (seeded by the step)."""
    import numpy as np

    x = np.random.default_rng(step).normal(size=(8, 4)).astype(np.float32)
    return {"x": x, "y": x.sum(axis=1)}


class MLP(nnx.Module):
    """``x [B, 4] -> [B]``: two dense layers, for the data-parallel process-group fit."""

    def __init__(self, seed=0):
        rngs = nnx.Rngs(seed)
        self.hidden = nnx.Linear(4, 16, rngs=rngs)
        self.out = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.tanh(self.hidden(x)))[:, 0]


def sum_batch_16(step):
    """Batch ``step``: 16 rows (2 per device of 2 processes x 4 devices) of 4 normal features whose
    target is their sum (seeded by the step)."""
    import numpy as np

    x = np.random.default_rng(step).normal(size=(16, 4)).astype(np.float32)
    return {"x": x, "y": x.sum(axis=1)}


def slow_sum_batch_16(step):
    """:func:`sum_batch_16`, a quarter second late (a fit slow enough to lose a worker in)."""
    import time

    time.sleep(0.25)
    return sum_batch_16(step)
