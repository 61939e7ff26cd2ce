"""MoE feed-forward layer: parity with a dense FFN, einsum == scatter dispatch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from carlskit.moe import FeedForward, MoEFeedForward, combine, dispatch, top2_gating

D_MODEL, HIDDEN, EXPERTS = 8, 16, 4


def make_layer(**kwargs):
    return MoEFeedForward(D_MODEL, HIDDEN, EXPERTS, rngs=nnx.Rngs(0), **kwargs)


def tokens(batch=2, length=8, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(batch, length, D_MODEL)).astype(np.float32))


def test_moe_with_dense_weights_in_every_expert_equals_dense_ffn():
    dense = FeedForward(D_MODEL, HIDDEN, rngs=nnx.Rngs(1))
    layer = make_layer(capacity_factor=8.0, second_expert_policy="all")
    layer.expert_wi[...] = jnp.broadcast_to(dense.wi[...], layer.expert_wi.shape)
    layer.expert_wo[...] = jnp.broadcast_to(dense.wo[...], layer.expert_wo.shape)
    x = tokens()
    y, routing = layer(x)
    assert float(routing.metrics["dropped_tokens"]) == 0.0
    np.testing.assert_allclose(np.asarray(y), np.asarray(dense(x)), rtol=1e-5, atol=1e-5)


def test_einsum_and_scatter_dispatch_give_same_outputs_and_gradients():
    x = tokens(seed=1)

    def loss(layer, x):
        y, routing = layer(x)
        return jnp.sum(jnp.sin(y)) + routing.aux_loss

    results = {}
    for mode in ("scatter", "einsum"):
        layer = make_layer(capacity_factor=1.0, second_expert_policy="all", dispatch=mode)  # some drops
        value, (grad_layer, grad_x) = nnx.value_and_grad(loss, argnums=(0, 1))(layer, x)
        results[mode] = value, nnx.state(grad_layer), grad_x
    assert float(results["scatter"][0]) == pytest.approx(float(results["einsum"][0]), rel=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5),
        results["scatter"][1:], results["einsum"][1:],
    )
    assert float(jnp.abs(results["scatter"][1]["router_weights"][...]).sum()) > 0  # router is trained


def test_dispatch_functions_agree_on_random_routing():
    x = tokens(batch=3, length=6, seed=2)
    logits = jnp.asarray(np.random.default_rng(5).normal(size=(3, 6, EXPERTS)).astype(np.float32))
    routing = top2_gating(logits, 2, second_expert_policy="all")
    np.testing.assert_allclose(
        np.asarray(dispatch(routing, x, "scatter")), np.asarray(dispatch(routing, x, "einsum")), atol=1e-6
    )
    expert_out = jnp.asarray(np.random.default_rng(6).normal(size=(EXPERTS, 3, 2, D_MODEL)).astype(np.float32))
    np.testing.assert_allclose(
        np.asarray(combine(routing, expert_out, "scatter")), np.asarray(combine(routing, expert_out, "einsum")),
        atol=1e-5
    )
    with pytest.raises(ValueError, match="dispatch"):
        dispatch(routing, x, "magic")


def test_layer_options_and_bad_arguments():
    x = tokens(batch=2, length=8)
    for router in ("top1", "expert_choice"):
        y, routing = make_layer(router=router, group_size=4)(x)
        assert y.shape == x.shape and routing.slot_token.shape[0] == 4
    with pytest.raises(ValueError, match="router"):
        make_layer(router="top3")
    with pytest.raises(ValueError, match="group_size"):
        make_layer(group_size=5)(x)
