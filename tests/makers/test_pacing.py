"""A maker's CPU budget (``Maker(..., max_cpu_fraction=f)``): each slice computes at most ``f`` of
wall time, and a paced refresh still completes with every item written."""

import time

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from process_helpers import wait_until

from carlskit.bank import KnowledgeBank
from carlskit.makers import EmbeddingMaker, Maker
from carlskit.training import CheckpointStore

CHUNK_ROWS = 256


class ChunkedWork:
    """A maker function doing real CPU work (elementwise numpy, which runs in the calling thread) in
    chunks, calling ``pace()`` between them; records each round's thread CPU seconds."""

    def __init__(self):
        self.cpu_seconds: list[float] = []
        self.values = np.random.default_rng(0).normal(size=200_000)

    def __call__(self, context):
        began = time.thread_time()
        rows = []
        for start in range(0, len(context.items), CHUNK_ROWS):
            block = self.values
            for _ in range(10):
                block = np.sin(block) * 1.5
            rows.append(np.full((len(context.items[start:start + CHUNK_ROWS]), 4), context.version, np.float32))
            context.pace()
        context.bank.update("emb", context.items, np.concatenate(rows), version=context.version)
        self.cpu_seconds.append(time.thread_time() - began)


def refresh(tmp_path, fraction):
    """One paced round over 2048 items: (round status, the function's CPU seconds, its wall seconds)."""
    bank = KnowledgeBank()
    bank.create_table("emb", dim=4, initializer="zeros")
    store = CheckpointStore(tmp_path / str(fraction), keep=None)
    store.save({"w": np.float32(0)}, version=1)
    items = np.arange(2048)
    work = ChunkedWork()
    maker = Maker(work, items, poll_seconds=0.01, max_cpu_fraction=fraction).start(store, bank)
    try:
        maker.wait_for_version(1, timeout=60)
    finally:
        maker.stop()
    assert (bank.row_metadata("emb", items)["version"] == 1).all()  # the refresh completed, every item
    state = maker.status()["slices"][0]
    seconds = state["rounds"] and maker.events()[-1]["seconds"]
    return state, work.cpu_seconds[0], seconds


def test_a_paced_maker_computes_at_most_its_fraction_of_wall_time_and_still_completes(tmp_path):
    unpaced, unpaced_cpu, unpaced_wall = refresh(tmp_path, 1.0)
    paced, paced_cpu, paced_wall = refresh(tmp_path, 0.25)
    # Busy share of the round's wall time: measured by the pacer and, independently, as thread CPU time.
    assert paced["busy_fraction"] <= 0.25 + 0.02
    assert paced_cpu / paced_wall <= 0.25 + 0.03
    # Both are upper bounds that a loaded machine can only make easier (a preempted thread gets less
    # CPU, and the pacer sleeps in proportion to the busy wall time it measured). The baseline (no
    # pacing) never sleeps, so its busy share exceeds the paced one's (it was 0.9+ here). Comparing the
    # two runs' CPU shares or item rates was dropped (issue 43): the two runs meet different loads.
    assert unpaced["busy_fraction"] > paced["busy_fraction"] and unpaced_cpu > 0 and unpaced_wall > 0


class Encoder(nnx.Module):
    def __init__(self, seed: int = 0):
        self.linear = nnx.Linear(8, 4, rngs=nnx.Rngs(seed))


def encode(model, features):
    return jnp.tanh(model.linear(features))


def test_a_paced_embedding_maker_refreshes_every_item_batch_by_batch(tmp_path):
    features = np.random.default_rng(0).normal(size=(600, 8)).astype(np.float32)
    bank = KnowledgeBank()
    bank.create_table("emb", dim=4, initializer="zeros")
    store = CheckpointStore(tmp_path, keep=None)
    model = Encoder(seed=1)
    store.save({"model": nnx.state(model)}, version=1)
    items = np.arange(len(features))
    maker = Maker(EmbeddingMaker(Encoder, encode, features, batch_size=100), items, num_slices=2,
                  poll_seconds=0.01, max_cpu_fraction=0.5).start(store, bank)
    try:
        wait_until(lambda: (bank.row_metadata("emb", items)["version"] == 1).all(), seconds=60)
    finally:
        maker.stop()
    values, found = bank.lookup("emb", items)
    assert found.all() and np.allclose(values, np.asarray(encode(model, features)), atol=1e-5)
    assert all(s["busy_fraction"] <= 0.5 + 0.05 for s in maker.status()["slices"])


@pytest.mark.parametrize("fraction, error", [(0.0, ValueError), (1.5, ValueError), (float("nan"), ValueError),
                                             ("half", TypeError)])
def test_a_bad_cpu_fraction_is_refused_naming_it(fraction, error):
    with pytest.raises(error, match="max_cpu_fraction"):
        Maker(lambda context: None, np.arange(4), max_cpu_fraction=fraction)
