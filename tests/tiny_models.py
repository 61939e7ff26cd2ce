"""Small Flax models shared by tests (importable by Dask workers: ``tests/`` is on their path)."""

from flax import nnx


class Linear(nnx.Module):
    """``x [B, 4] -> [B]``: one dense layer, the smallest model a Trainer can fit."""

    def __init__(self, seed=0):
        self.linear = nnx.Linear(4, 1, rngs=nnx.Rngs(seed))

    def __call__(self, x):
        return self.linear(x)[:, 0]
