"""MoEModel: loss, determinism, training, evaluation, generation, dense baseline."""

import jax
import numpy as np
import pytest
from flax import nnx

from carlskit.moe import MoEFeedForward, MoEModel

VOCAB, LENGTH = 16, 12


def tiny(**kwargs):
    """One configuration for every test, so jit caches are shared (same graph, same shapes)."""
    config = dict(vocab_size=VOCAB, num_layers=2, d_model=16, num_heads=2, num_experts=4, max_length=LENGTH,
                  second_expert_policy="all")
    config.update(kwargs)
    return MoEModel(**config)


def repeating_sequences(rows, seed=0):
    """Sequences a, a+1, a+2, ... mod VOCAB: learnable next-token structure."""
    start = np.random.default_rng(seed).integers(0, VOCAB, (rows, 1))
    return ((start + np.arange(LENGTH + 1)) % VOCAB).astype(np.int32)


def test_same_seed_same_parameters_and_loss_includes_aux():
    a, b, c = tiny(seed=3), tiny(seed=3), tiny(seed=4)
    leaves = lambda m: jax.tree.leaves(nnx.state(m))
    assert all(np.array_equal(x, y) for x, y in zip(leaves(a), leaves(b)))
    assert not all(np.array_equal(x, y) for x, y in zip(leaves(a), leaves(c)))
    metrics = a.evaluate(repeating_sequences(32))
    assert metrics["loss"] == pytest.approx(metrics["cross_entropy"] + 1e-2 * metrics["aux_loss"], rel=1e-6)
    assert isinstance(a.blocks[1].ffn, MoEFeedForward) and not isinstance(a.blocks[0].ffn, MoEFeedForward)


def test_fit_lowers_loss_then_evaluate_and_generate():
    model = tiny()
    data = repeating_sequences(64)
    before = model.evaluate(data, batch_size=32)["cross_entropy"]
    history = model.fit(data, steps=40, batch_size=32, learning_rate=1e-2)
    after = model.evaluate(data, batch_size=32)
    assert after["cross_entropy"] < 0.5 * before
    assert len(history) == 40 and history.column("expert_load").shape == (40, 1, 4)
    assert [r["step"] for r in history] == list(range(1, 41))
    out = model.generate(data[:2, :4], 4)
    assert out.shape == (2, 8) and np.array_equal(out[:, :4], data[:2, :4])
    assert np.mean(out[:, 4:] == data[:2, 4:8]) > 0.5  # learned to continue the sequence


def test_dense_baseline_and_bad_inputs():
    dense = tiny(num_experts=0)
    assert dense.blocks[1].ffn.wi.shape == (16, 2 * 64)  # top-2: twice the expert width
    assert dense.blocks[0].ffn.wi.shape == (16, 64)
    with pytest.raises(ValueError, match="tokens"):
        dense.shard_batch(np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="max_length"):
        dense.shard_batch(np.zeros((2, LENGTH + 5), np.int32))
    with pytest.raises(TypeError, match="mesh"):  # a wrong type: TypeError since issue 16 (was ValueError)
        tiny(mesh="data")
    with pytest.raises(ValueError, match="num_heads"):
        tiny(num_heads=3)
