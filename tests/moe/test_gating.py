"""Gating: GShard Algorithm 1 golden values and rules, Switch top-1, expert choice."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from carlskit.moe import (
    expert_capacity,
    expert_choice_gating,
    load_balancing_loss,
    router_z_loss,
    top1_gating,
    top2_gating,
)

GOLDEN_GATES = np.array([[0.5, 0.4, 0.1], [0.3, 0.3, 0.4], [0.1, 0.2, 0.7], [0.8, 0.2, 0.0]])


def reference_top2_slots(gates, capacity, attempt_second):
    """Algorithm 1 as a token loop over one group: slot_token[e, c] (S when empty)."""
    num_tokens, num_experts = gates.shape
    slots = np.full((num_experts, capacity), num_tokens)
    count = np.zeros(num_experts, int)
    order = np.argsort(-gates, axis=1, kind="stable")
    for s in range(num_tokens):  # pass 1: overflow dropped but counted
        e = order[s, 0]
        if count[e] < capacity:
            slots[e, count[e]] = s
        count[e] += 1
    for s in range(num_tokens):  # pass 2: after all first choices, if attempted and it fits
        e = order[s, 1]
        if attempt_second[s]:
            if count[e] < capacity:
                slots[e, count[e]] = s
            count[e] += 1
    return slots


def test_golden_aux_loss():
    routing = top2_gating(jnp.log(GOLDEN_GATES)[None], 4, second_expert_policy="all")
    # E^2 * mean_e(first-choice count_e / S * mean gate_e) = 9 * mean(.5*.425, 0*.275, .5*.3)
    assert float(routing.aux_loss) == pytest.approx(1.0875, abs=1e-5)
    assert float(load_balancing_loss(jnp.asarray(GOLDEN_GATES)[None],
                                     jax.nn.one_hot(jnp.array([[0, 2, 2, 0]]), 3))) == pytest.approx(1.0875, abs=1e-5)


def test_balanced_router_scores_one():
    logits = jnp.log(jnp.eye(4) * 0.7 + 0.1)[None]  # token i prefers expert i, mean gate 1/4
    assert float(top2_gating(logits, 2, second_expert_policy="none").aux_loss) == pytest.approx(1.0, abs=1e-5)


def test_expert_capacity_rounds_up_and_clips():
    assert expert_capacity(1024, 8, 1.0) == 256
    assert expert_capacity(10, 3, 1.0) == 7  # ceil(20 / 3)
    assert expert_capacity(10, 3, 1.0, k=1) == 4
    assert expert_capacity(4, 3, 2.0) == 4  # never more than S
    assert expert_capacity(16, 64, 0.1) == 1
    with pytest.raises(ValueError, match="capacity_factor"):
        expert_capacity(16, 4, 0.0)


def test_positions_follow_algorithm_1():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 12, 5)).astype(np.float32)
    uniform = rng.uniform(size=(3, 12)).astype(np.float32)
    gates = np.asarray(jax.nn.softmax(logits, axis=-1))
    top = np.sort(gates, axis=-1)[..., ::-1]
    g2 = top[..., 1] / (top[..., 0] + top[..., 1])
    random_attempt = 2 * g2 > uniform
    # policy "random" at three capacities; "all" and "none" at one (5 compilations in all)
    cases = [("random", c, random_attempt) for c in (1, 3, 5)]
    cases += [("all", 3, np.ones((3, 12), bool)), ("none", 3, np.zeros((3, 12), bool))]
    for policy, capacity, attempt in cases:
        routing = top2_gating(jnp.asarray(logits), capacity, second_expert_policy=policy, second_choice_uniform=uniform)
        for g in range(3):
            expected = reference_top2_slots(gates[g], capacity, attempt[g])
            np.testing.assert_array_equal(np.asarray(routing.slot_token[g]), expected, err_msg=f"{policy} C={capacity}")


def test_capacity_respected_and_at_most_two_experts():
    logits = np.random.default_rng(0).normal(size=(4, 32, 8)).astype(np.float32) * 3
    combine, dispatch, aux, metrics = top2_gating(logits, 5, rng=jax.random.key(1))
    assert combine.shape == dispatch.shape == (4, 32, 8, 5) and dispatch.dtype == jnp.bool_
    assert int(dispatch.sum(axis=1).max()) <= 1  # one token per slot
    assert int(dispatch.sum(axis=(1, 3)).max()) <= 5  # capacity per expert
    assert int(dispatch.sum(axis=(2, 3)).max()) <= 2  # experts per token
    assert int(dispatch.sum(axis=3).max()) <= 1  # one slot per (token, expert)
    assert float(metrics["dropped_first"]) > 0  # 32 tokens, 8 x 5 slots, skewed router
    assert 0.0 <= float(metrics["dropped_tokens"]) <= float(metrics["dropped_first"])
    np.testing.assert_array_equal(np.asarray(combine > 0), np.asarray(dispatch))


def test_combine_weights_sum_to_one_without_drops():
    logits = np.random.default_rng(2).normal(size=(2, 16, 4)).astype(np.float32)
    combine, _, _, metrics = top2_gating(logits, 16, second_expert_policy="all")
    np.testing.assert_allclose(np.asarray(combine.sum(axis=(2, 3))), 1.0, atol=1e-6)
    assert float(metrics["dropped_tokens"]) == 0.0 and float(metrics["dropped_second"]) == 0.0
    np.testing.assert_allclose(float(metrics["expert_load"].sum()), 1.0, atol=1e-6)


def test_random_policy_needs_rng_and_is_jit_and_vmap_able():
    logits = jnp.asarray(np.random.default_rng(3).normal(size=(2, 8, 4)).astype(np.float32))
    with pytest.raises(ValueError, match="rng"):
        top2_gating(logits, 4)
    uniform = jnp.full((2, 8), 0.5)  # rng draws u ~ U(0, 1); the multi-device test uses rng
    jitted = jax.jit(lambda l, u: top2_gating(l, 4, second_choice_uniform=u).combine_weights)(logits, uniform)
    assert jitted.shape == (2, 8, 4, 4)
    vmapped = jax.vmap(lambda l: top2_gating(l, 4, second_expert_policy="all").slot_weight)(logits[:, None])
    direct = top2_gating(logits, 4, second_expert_policy="all").slot_weight
    np.testing.assert_allclose(np.asarray(vmapped[:, 0]), np.asarray(direct), atol=1e-6)


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="logits"):
        top2_gating(jnp.zeros((8, 4)), 2, second_expert_policy="all")
    with pytest.raises(ValueError, match="second_expert_policy"):
        top2_gating(jnp.zeros((1, 8, 4)), 2, second_expert_policy="sometimes")
    with pytest.raises(ValueError, match="capacity"):
        top2_gating(jnp.zeros((1, 8, 4)), 0, second_expert_policy="all")


def test_top1_switch_routing():
    routing = top1_gating(jnp.log(GOLDEN_GATES)[None], 1)
    np.testing.assert_array_equal(np.asarray(routing.slot_token[0]), [[0], [4], [1]])
    np.testing.assert_allclose(np.asarray(routing.slot_weight[0]), [[0.5], [0.0], [0.4]], atol=1e-6)
    assert float(routing.metrics["dropped_first"]) == 0.5
    assert float(routing.aux_loss) == pytest.approx(1.0875, abs=1e-5)


def test_expert_choice_routing_is_balanced():
    logits = np.random.default_rng(4).normal(size=(2, 16, 4)).astype(np.float32)
    combine, dispatch, aux, _ = expert_choice_gating(logits, 8)
    np.testing.assert_array_equal(np.asarray(dispatch.sum(axis=(1, 3))), 8)  # every expert full
    gates = jax.nn.softmax(logits, axis=-1)
    np.testing.assert_allclose(np.asarray(combine.sum(axis=3)), np.asarray(gates * dispatch.any(axis=3)), atol=1e-6)
    assert float(aux) == 0.0


def test_router_z_loss_formula():
    logits = jnp.array([[[0.0, 0.0], [1.0, 2.0]]])
    expected = np.mean(np.log([2.0, np.e + np.e**2]) ** 2)
    assert float(router_z_loss(logits)) == pytest.approx(expected, rel=1e-5)


def assert_distinct_experts_and_unit_weights(routing):
    """Every token holds at most one slot per expert; a kept token's weights sum to 1."""
    dispatch = np.asarray(routing.dispatch_mask).astype(bool)  # [G, S, E, C]
    assert dispatch.sum(axis=3).max() <= 1, "a token was sent twice to the same expert"
    weights = np.asarray(routing.combine_weights, np.float32).sum(axis=(2, 3))
    kept = dispatch.any(axis=(2, 3))
    np.testing.assert_allclose(weights[kept], 1.0, atol=1e-2 if routing.slot_weight.dtype == jnp.bfloat16 else 1e-6)


EXTREME_LOGITS = np.array(
    [
        [100.0, -100.0, -100.0, -100.0],  # softmax underflows: every gate but expert 0's is exactly 0
        [-100.0, 100.0, -100.0, -100.0],
        [0.0, 0.0, 0.0, 0.0],  # four-way tie
        [5.0, 5.0, -100.0, -100.0],  # two-way tie
        [100.0, 0.0, -100.0, -100.0],
        [-100.0, -100.0, -100.0, 100.0],
    ],
    np.float32,
)[None]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_second_choice_is_another_expert_for_extreme_gaps_ties_and_bfloat16(dtype):
    # Before: with every other gate exactly 0 and the first choice expert 0, argmax of the masked
    # gates returned expert 0 again and g2 was read from the unmasked gates: the token took two
    # slots of expert 0 at 0.5 + 0.5, and kept only 0.5 when the second slot overflowed.
    logits = jnp.asarray(EXTREME_LOGITS, dtype)
    # Roomy capacity, then so tight (C=1) that any second slot of expert 0 overflows; with drops,
    # weights sum to 1 only if kept gates are renormalised afterwards.
    cases = [("all", 6, False), ("all", 1, True), ("all", 1, False), ("random", 1, True), ("sampling", 6, False)]
    for policy, capacity, renormalize in cases:
        routing = top2_gating(
            logits, capacity, second_expert_policy=policy, rng=jax.random.key(3),
            renormalize_after_drops=renormalize,
        )
        if renormalize or capacity == 6:
            assert_distinct_experts_and_unit_weights(routing)
        combine = np.asarray(routing.combine_weights, np.float32)[0]  # [S, E, C]
        assert combine[0, 0].sum() == 1.0 and combine[0].sum() == 1.0  # token 0: all weight on expert 0
    # Ties: first choice the lowest index, second the next one, half the weight each.
    routing = top2_gating(logits, 6, second_expert_policy="all")
    per_expert = np.asarray(routing.combine_weights, np.float32)[0].sum(axis=2)
    np.testing.assert_allclose(per_expert[2], [0.5, 0.5, 0, 0])
    np.testing.assert_allclose(per_expert[3], [0.5, 0.5, 0, 0])
    # A second choice with gate 0 takes no slot: only the four tokens with two live gates use two slots.
    dispatch = np.asarray(routing.dispatch_mask)[0]
    assert dispatch.sum(axis=(1, 2)).tolist() == [1, 1, 2, 2, 1, 1]


def test_large_random_logits_give_two_distinct_experts_summing_to_one():
    logits = np.random.default_rng(7).normal(size=(4, 64, 8)).astype(np.float32) * 100.0
    for dtype in (jnp.float32, jnp.bfloat16):
        routing = top2_gating(jnp.asarray(logits, dtype), 64, second_expert_policy="all")
        assert_distinct_experts_and_unit_weights(routing)
        assert float(routing.metrics["dropped_tokens"]) == 0.0
