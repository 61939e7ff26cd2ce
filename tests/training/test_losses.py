import jax
import jax.numpy as jnp
import numpy as np
import pytest

from carlskit.training import graph_regularization, info_nce, masked_cross_entropy, pairwise_distance


def test_distances_by_hand():
    x = jnp.array([[1.0, 0.0]])
    n = jnp.array([[[0.0, 1.0], [2.0, 0.0]]])
    np.testing.assert_allclose(pairwise_distance(x, n, "l2"), [[2.0, 1.0]])
    np.testing.assert_allclose(pairwise_distance(x, n, "l1"), [[2.0, 1.0]])
    np.testing.assert_allclose(pairwise_distance(x, n, "cosine"), [[1.0, 0.0]], atol=1e-6)
    with pytest.raises(ValueError, match="distance"):
        pairwise_distance(x, n, "kl")


def test_graph_regularization_weights_and_gradient_only_through_samples():
    samples = jnp.array([[1.0, 0.0], [0.0, 0.0]])
    neighbors = jnp.array([[[0.0, 0.0], [1.0, 1.0]], [[3.0, 4.0], [9.0, 9.0]]])
    weights = jnp.array([[1.0, 0.5], [1.0, 0.0]])  # the (9, 9) neighbour is padding
    value = graph_regularization(samples, neighbors, weights, "l2")
    assert float(value) == pytest.approx((1.0 + 0.5 * 1.0 + 25.0) / 2)
    grad_neighbors = jax.grad(lambda n: graph_regularization(samples, n, weights))(neighbors)
    assert float(jnp.abs(grad_neighbors).sum()) == 0.0
    with pytest.raises(ValueError, match="weights"):
        graph_regularization(samples, neighbors, weights[:, :1])


def test_masked_cross_entropy_ignores_unlabelled():
    logits = jnp.array([[10.0, 0.0], [0.0, 10.0]])
    value = masked_cross_entropy(logits, jnp.array([0, 0]), jnp.array([True, False]))
    assert float(value) < 1e-3
    assert float(masked_cross_entropy(logits, jnp.array([0, 0]), jnp.array([False, False]))) == 0.0


def test_shapes_that_would_broadcast_are_named_errors():
    samples = jnp.ones((4, 3))
    with pytest.raises(ValueError, match=r"neighbors \(1, 2, 3\)"):  # used to broadcast to a wrong mean
        graph_regularization(samples, jnp.zeros((1, 2, 3)), jnp.ones((1, 2)))
    with pytest.raises(ValueError, match=r"neighbors \(4, 2, 5\)"):
        pairwise_distance(samples, jnp.zeros((4, 2, 5)))
    logits = jnp.zeros((4, 3))
    with pytest.raises(ValueError, match=r"mask \(4, 1\)"):
        masked_cross_entropy(logits, jnp.zeros(4, int), jnp.ones((4, 1), bool))
    with pytest.raises(ValueError, match=r"labels \(4, 1\)"):
        masked_cross_entropy(logits, jnp.zeros((4, 1), int), jnp.ones(4, bool))
    with pytest.raises(TypeError, match="labels must be int"):
        masked_cross_entropy(logits, jnp.zeros(4), jnp.ones(4, bool))


def test_info_nce_temperature_must_be_positive():
    with pytest.raises(ValueError, match="temperature must be > 0, got 0"):
        info_nce(jnp.ones((2, 3)), jnp.ones((2, 3)), temperature=0)
