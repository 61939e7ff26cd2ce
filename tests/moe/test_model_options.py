"""MoEModel options: padding-aware routing, the z-loss as a training term, bfloat16 training,
explicit expert capacity, and the layer's dtypes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from carlskit.moe import MoEFeedForward, MoEModel, top2_gating

VOCAB, LENGTH, PAD = 16, 12, 15


def tiny(**kwargs):
    config = dict(vocab_size=VOCAB, num_layers=2, d_model=16, num_heads=2, num_experts=4, max_length=LENGTH,
                  second_expert_policy="all")
    config.update(kwargs)
    return MoEModel(**config)


def repeating_sequences(rows, seed=0):
    """a, a+1, a+2, ... mod 15: learnable, and never the padding id 15."""
    start = np.random.default_rng(seed).integers(0, PAD, (rows, 1))
    return ((start + np.arange(LENGTH + 1)) % PAD).astype(np.int32)


def test_padding_takes_no_capacity_and_changes_nothing_for_real_tokens():
    # Rows of 8 real tokens padded to 13, against the same rows padded to 9 only (the last real
    # input needs a target). With two slots per expert and group, padding that took first
    # choices would push real tokens' second choices out (and count in the aux loss).
    model = tiny(pad_id=PAD, expert_capacity=2)
    padded = np.full((4, LENGTH + 1), PAD, np.int32)
    padded[:, :8] = repeating_sequences(4)[:, :8]
    alone, with_padding = model.evaluate(padded[:, :9]), model.evaluate(padded)
    assert with_padding["target_tokens"] == alone["target_tokens"] == 4 * 7
    for key in ("cross_entropy", "aux_loss", "router_z_loss"):
        assert with_padding[key] == pytest.approx(alone[key], rel=1e-5, abs=1e-6), key
    # The same rows without pad_id: padding is routed, takes slots, and the aux loss moves.
    unaware = tiny(expert_capacity=2)
    assert unaware.evaluate(padded)["aux_loss"] != pytest.approx(alone["aux_loss"], rel=1e-3)


def test_layer_routes_padded_tokens_nowhere():
    layer = MoEFeedForward(8, 16, 4, second_expert_policy="all", capacity_factor=0.5, rngs=nnx.Rngs(0))
    x = np.random.default_rng(0).normal(size=(2, 8, 8)).astype(np.float32)
    paddings = np.zeros((2, 8), np.int32)
    paddings[:, 5:] = 1
    y, routing = layer(jnp.asarray(x), paddings=jnp.asarray(paddings))
    assert not np.asarray(y)[:, 5:].any()  # padded tokens: no expert, output 0
    x_other = x.copy()
    x_other[:, 5:] = 100.0  # whatever the padding holds, real tokens are routed the same
    y_other, _ = layer(jnp.asarray(x_other), paddings=jnp.asarray(paddings))
    np.testing.assert_allclose(np.asarray(y_other)[:, :5], np.asarray(y)[:, :5], rtol=1e-6)
    with pytest.raises(ValueError, match="paddings"):
        layer(jnp.asarray(x), paddings=jnp.zeros((2, 7)))


def test_layer_passes_importance_to_its_gating():
    # praxis semantics through the layer: importance 1 = routed as without it, 0 = no expert (output
    # 0), 0.5 = a second choice only; the tokens' routing equals top2_gating's on the same logits.
    layer = MoEFeedForward(8, 16, 4, second_expert_policy="all", expert_capacity=16, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 8, 8)).astype(np.float32))
    plain, _ = layer(x)
    same, _ = layer(x, importance=jnp.ones((2, 8)))
    np.testing.assert_allclose(np.asarray(same), np.asarray(plain), rtol=1e-6)
    importance = np.ones((2, 8), np.float32)
    importance[:, 6:] = 0.0
    importance[:, 4] = 0.5
    y, routing = layer(x, importance=jnp.asarray(importance))
    assert not np.asarray(y)[:, 6:].any()
    np.testing.assert_allclose(np.asarray(y)[:, :4], np.asarray(plain)[:, :4], rtol=1e-5)
    logits = jnp.einsum("gsm,me->gse", x, layer.router_weights[...])
    expected = top2_gating(logits, 16, second_expert_policy="all", importance=jnp.asarray(importance))
    np.testing.assert_allclose(np.asarray(routing.combine_weights), np.asarray(expected.combine_weights), atol=1e-6)
    with pytest.raises(ValueError, match="importance"):
        layer(x, importance=jnp.ones((2, 7)))


def test_router_z_loss_is_a_training_term():
    data = repeating_sequences(8)
    plain, weighted = tiny(seed=1), tiny(seed=1, z_loss_weight=0.5)
    metrics = weighted.evaluate(data)
    expected = metrics["cross_entropy"] + 1e-2 * metrics["aux_loss"] + 0.5 * metrics["router_z_loss"]
    assert metrics["loss"] == pytest.approx(expected, rel=1e-6)

    def router_grad(model):
        grads = nnx.grad(lambda m: m.loss(jnp.asarray(data)))(model)
        return np.asarray(grads["blocks"][1]["ffn"]["router_weights"][...])

    assert np.abs(router_grad(plain) - router_grad(weighted)).max() > 1e-4  # the z-loss pulls the router


def test_bfloat16_training_keeps_float32_master_weights_and_tracks_float32():
    data = repeating_sequences(64)
    histories = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        model = tiny(dtype=dtype, second_expert_policy="random", seed=2)
        histories[dtype] = model.fit(data, steps=30, batch_size=16, learning_rate=1e-2,
                                     seed=0).column("cross_entropy")
        assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
    logits, routings = model(jnp.asarray(data[:2, :-1]))
    assert logits.dtype == jnp.float32 and routings[0].slot_weight.dtype == jnp.bfloat16
    # Stated tolerance: every step's bfloat16 loss within 5% of the float32 loss (bfloat16 keeps
    # 8 mantissa bits: ~0.4% per rounding), and both learn (loss halves).
    relative = np.abs(histories[jnp.bfloat16] - histories[jnp.float32]) / histories[jnp.float32]
    assert relative.max() < 0.05, relative
    assert histories[jnp.bfloat16][-1] < 0.5 * histories[jnp.bfloat16][0]


def test_explicit_expert_capacity_and_layer_dtypes():
    layer = MoEFeedForward(
        8, 16, 4, expert_capacity=3, fprop_dtype=jnp.bfloat16, mask_dtype=jnp.int32,
        second_expert_policy="all", rngs=nnx.Rngs(0),
    )
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 8, 8)).astype(np.float32))
    y, routing = layer(x)
    assert routing.capacity == layer.capacity(8) == 3
    assert y.dtype == jnp.float32 and routing.slot_weight.dtype == jnp.bfloat16
    assert routing.dispatch_mask.dtype == jnp.int32
    reference, _ = MoEFeedForward(8, 16, 4, expert_capacity=3, second_expert_policy="all", rngs=nnx.Rngs(0))(x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(reference), rtol=0.05, atol=0.05)
    for kwargs, name in ((dict(expert_capacity=0), "expert_capacity"), (dict(fprop_dtype=jnp.int8), "fprop_dtype"),
                         (dict(gating_logit_cap=-1.0), "gating_logit_cap")):
        with pytest.raises((TypeError, ValueError), match=name):
            MoEFeedForward(8, 16, 4, rngs=nnx.Rngs(0), **kwargs)
    for kwargs, name in ((dict(pad_id=VOCAB), "pad_id"), (dict(dtype="int32"), "dtype"),
                         (dict(num_experts=0, second_expert_threshold=0.0), "second_expert_threshold")):
        with pytest.raises((TypeError, ValueError), match=name):
            tiny(**kwargs)
