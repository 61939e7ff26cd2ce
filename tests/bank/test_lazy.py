"""The lazy update rule (mean or sum) as pure functions, against hand-computed values."""

import numpy as np
import pytest

from carlskit.bank import adagrad_step, combine_gradients, sgd_step


def test_average_per_key():
    grads = np.array([[1, 0], [3, 2], [5, 5]], np.float32)
    out = combine_gradients(grads, np.array([0, 0, 1]), 2)
    np.testing.assert_array_equal(out.group_index, [0, 1])
    np.testing.assert_allclose(out.gradient, [[2, 1], [5, 5]])
    np.testing.assert_array_equal(out.count, [2, 1])
    assert out.dropped_nonfinite == 0 and out.dropped_outliers == 0


def test_sum_per_key():
    # combine="sum": key 0 [1+3, 0+2], key 1 alone; with outliers: norms 1, 2, 3, 100 -> 100 dropped
    grads = np.array([[1, 0], [3, 2], [5, 5]], np.float32)
    out = combine_gradients(grads, np.array([0, 0, 1]), 2, combine="sum")
    np.testing.assert_allclose(out.gradient, [[4, 2], [5, 5]])
    np.testing.assert_array_equal(out.count, [2, 1])
    grads = np.array([[1, 0], [0, 2], [3, 0], [0, 100]], np.float32)
    out = combine_gradients(grads, np.zeros(4, np.int64), 1, combine="sum")
    assert out.dropped_outliers == 1
    np.testing.assert_allclose(out.gradient, [[4, 2]])
    with pytest.raises(ValueError, match="combine"):
        combine_gradients(grads, np.zeros(4, np.int64), 1, combine="median")


def test_nonfinite_dropped_and_counted():
    grads = np.array([[1, 1], [np.nan, 0], [3, 3], [np.inf, 1]], np.float32)
    out = combine_gradients(grads, np.array([0, 0, 0, 1]), 2)
    np.testing.assert_array_equal(out.group_index, [0])  # key 1 had only an Inf gradient
    np.testing.assert_allclose(out.gradient, [[2, 2]])
    assert out.dropped_nonfinite == 2


def test_outlier_by_median_and_mad():
    # norms 1, 2, 3, 100: median 2.5, |n - 2.5| = 1.5, .5, .5, 97.5 -> MAD 1.0
    # limit = 2.5 + 3 * 1.4826 * 1.0 = 6.9478: only 100 is dropped
    grads = np.array([[1, 0], [0, 2], [3, 0], [0, 100]], np.float32)
    out = combine_gradients(grads, np.zeros(4, np.int64), 1, outlier_threshold=3.0)
    assert out.dropped_outliers == 1
    np.testing.assert_allclose(out.gradient, [[4 / 3, 2 / 3]], rtol=1e-6)
    # a lower threshold (limit 2.5 + 0.2 * 1.4826 = 2.797) also drops the norm-3 gradient
    out = combine_gradients(grads, np.zeros(4, np.int64), 1, outlier_threshold=0.2)
    assert out.dropped_outliers == 2
    np.testing.assert_allclose(out.gradient, [[0.5, 1.0]])


def test_no_outlier_rule_below_three_gradients():
    grads = np.array([[1, 0], [0, 100]], np.float32)
    out = combine_gradients(grads, np.zeros(2, np.int64), 1)
    assert out.dropped_outliers == 0
    np.testing.assert_allclose(out.gradient, [[0.5, 50]])


def test_optimizer_steps():
    v = np.array([[1.0, 2.0]], np.float32)
    g = np.array([[0.5, -1.0]], np.float32)
    np.testing.assert_allclose(sgd_step(v, g, 0.1), [[0.95, 2.1]])
    new_v, acc = adagrad_step(v, np.full_like(v, 0.1), g, 0.1, 1e-7)
    np.testing.assert_allclose(acc, [[0.35, 1.1]])
    np.testing.assert_allclose(new_v, [[1 - 0.1 * 0.5 / np.sqrt(0.35 + 1e-7),
                                        2 + 0.1 / np.sqrt(1.1 + 1e-7)]], rtol=1e-6)


def test_matches_a_per_key_loop_on_random_groups():
    rng = np.random.default_rng(3)
    grads = rng.normal(size=(500, 5)).astype(np.float32)
    grads[rng.integers(0, 500, 20), 0] = np.nan
    groups = rng.integers(0, 200, 500)
    out = combine_gradients(grads, groups, 200, outlier_threshold=2.0)
    dropped = 0
    expected = {}
    for key in range(200):
        g = grads[groups == key]
        g = g[np.isfinite(g).all(1)]
        if len(g) >= 3:
            norms = np.linalg.norm(g.astype(np.float64), axis=1)
            med = np.median(norms)
            keep = norms <= med + 2.0 * 1.4826 * np.median(np.abs(norms - med))
            dropped += int((~keep).sum())
            g = g[keep]
        if len(g):
            expected[key] = g.mean(0)
    assert out.dropped_outliers == dropped and out.dropped_nonfinite == 20
    assert list(out.group_index) == sorted(expected)
    np.testing.assert_allclose(out.gradient, np.stack([expected[k] for k in sorted(expected)]),
                               rtol=1e-5, atol=1e-6)


def test_one_gradient_per_key_in_key_order_passes_through_and_still_drops_nonfinite():
    # the common case (one trainer: each looked-up row cached one gradient): no reordering, no copy
    grads = np.array([[1, 2], [np.inf, -np.inf], [5, 6], [7, np.nan]], np.float32)
    out = combine_gradients(grads, np.array([0, 2, 3, 5]), 6, combine="sum")
    np.testing.assert_array_equal(out.group_index, [0, 3])
    np.testing.assert_array_equal(out.gradient, [[1, 2], [5, 6]])
    np.testing.assert_array_equal(out.count, [1, 1])
    assert out.dropped_nonfinite == 2
    huge = np.full((1, 64), 3e38, np.float32)  # finite rows whose float32 sum would overflow
    assert combine_gradients(huge, np.array([0]), 1).dropped_nonfinite == 0


def test_lookup_repeating_a_key_applies_its_cached_gradients_once():
    from carlskit.bank import KnowledgeBank

    bank = KnowledgeBank()
    bank.create_table("t", 2, initializer="zeros", optimizer="sgd", learning_rate=1.0, max_pending=4)
    bank.lookup("t", np.arange(4), insert_missing=True)
    bank.apply_gradients("t", np.array([1, 3]), np.array([[1, 1], [2, 2]], np.float32))
    values, _ = bank.lookup("t", np.array([3, 1, 3, 3, 0, 1]))
    np.testing.assert_array_equal(values, [[-2, -2], [-1, -1], [-2, -2], [-2, -2], [0, 0], [-1, -1]])
    assert bank.stats()["tables"]["t"]["optimizer_steps"] == 2
