"""Gating options of praxis' top2_gating_on_logits, each against a hand-computed case."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from carlskit.moe import expert_capacity, top2_gating

# Four tokens, three experts (the golden case of test_gating.py).
GATES = np.array([[0.5, 0.4, 0.1], [0.3, 0.3, 0.4], [0.1, 0.2, 0.7], [0.8, 0.2, 0.0]])
LOGITS = jnp.log(jnp.asarray(GATES, jnp.float32))[None]  # softmax(LOGITS) = GATES
EMPTY = 4  # slot_token of an empty slot (S)


def slots(routing):
    return np.asarray(routing.slot_token[0]), np.asarray(routing.slot_weight[0], np.float32)


def token_weights(routing):
    """[S] sum of each token's combine weights."""
    return np.asarray(routing.combine_weights, np.float32)[0].sum(axis=(1, 2))


def test_padded_tokens_get_no_expert_take_no_capacity_and_leave_the_aux_and_z_losses():
    shift = jnp.asarray([3.0, 1.0, 0.0, 0.0])[None, :, None]  # logsumexp(log g + c) = c: z-loss per token c^2
    paddings = jnp.asarray([[1, 0, 0, 0]])
    unpadded = top2_gating(LOGITS + shift, 2, second_expert_policy="all")
    padded = top2_gating(LOGITS + shift, 2, second_expert_policy="all", paddings=paddings)
    # Unpadded, token 0 fills expert 0 first and token 1's second choice (expert 0) overflows.
    assert 1 not in slots(unpadded)[0][0]
    # Padded: token 0 takes nothing, so token 3 moves up and token 1's second choice fits.
    # pass 1: t1 -> e2, t2 -> e2, t3 -> e0; pass 2: t1 -> e0 (tie .3/.3: lower index), t2 -> e1, t3 -> e1
    token, weight = slots(padded)
    np.testing.assert_array_equal(token, [[3, 1], [2, 3], [1, 2]])
    np.testing.assert_allclose(weight, [[0.8, 0.3 / 0.7], [0.2 / 0.9, 0.2], [0.4 / 0.7, 0.7 / 0.9]], atol=1e-6)
    assert not np.asarray(padded.dispatch_mask)[0, 0].any()
    # aux over tokens 1..3: first-choice fractions (1/3, 0, 2/3), mean gates (1.2, 0.7, 1.1) / 3
    expected_aux = 9 * np.mean(np.array([1 / 3, 0, 2 / 3]) * np.array([1.2, 0.7, 1.1]) / 3)
    assert float(padded.aux_loss) == pytest.approx(expected_aux, abs=1e-5)  # 1.1333
    assert float(unpadded.metrics["router_z_loss"]) == pytest.approx((9 + 1) / 4, abs=1e-5)
    assert float(padded.metrics["router_z_loss"]) == pytest.approx(1 / 3, abs=1e-5)
    assert float(padded.metrics["dropped_tokens"]) == 0.0  # a mean over the three real tokens
    np.testing.assert_allclose(token_weights(padded), [0, 1, 1, 1], atol=1e-6)


def test_importance_one_takes_a_first_choice_and_positive_importance_a_second():
    importance = jnp.asarray([[1.0, 0.5, 0.0, 1.0]])
    routing = top2_gating(LOGITS, 4, second_expert_policy="all", importance=importance)
    token, weight = slots(routing)
    # pass 1: t0 -> e0, t3 -> e0; pass 2 (after 2 first choices in e0): t0 -> e1, t1 -> e0, t3 -> e1.
    # Token 1 has no first choice, so its second choice gets the whole weight g2 / (0 + g2) = 1.
    np.testing.assert_array_equal(token, [[0, 3, 1, EMPTY], [0, 3, EMPTY, EMPTY], [EMPTY] * 4])
    np.testing.assert_allclose(weight, [[0.5 / 0.9, 0.8, 1.0, 0], [0.4 / 0.9, 0.2, 0, 0], [0] * 4], atol=1e-6)
    # aux over tokens 0 and 3 only: both first choices expert 0, its mean gate (0.5 + 0.8) / 2
    assert float(routing.aux_loss) == pytest.approx(9 * 0.65 / 3, abs=1e-5)
    np.testing.assert_allclose(token_weights(routing), [1, 1, 0, 1], atol=1e-6)


def test_second_expert_threshold_scales_the_random_policy():
    # Normalised g2 per token: 4/9, 3/7, 2/9, 1/5. "random" attempts the second choice if
    # u < g2 / threshold; with u = 0.85: threshold 0.5 (GShard's 2 * g2 > u) -> tokens 0, 1;
    # threshold 0.25 -> tokens 0, 1, 2 (2/9 / 0.25 = 0.89 > 0.85).
    uniform = jnp.full((1, 4), 0.85)
    experts = {}
    for threshold in (0.5, 0.25):
        routing = top2_gating(
            LOGITS, 4, second_expert_policy="random", second_choice_uniform=uniform,
            second_expert_threshold=threshold,
        )
        experts[threshold] = np.asarray(routing.dispatch_mask)[0].sum(axis=(1, 2)).tolist()
    assert experts == {0.5: [2, 2, 1, 1], 0.25: [2, 2, 2, 1]}
    with pytest.raises(ValueError, match="second_expert_threshold"):
        top2_gating(LOGITS, 4, second_expert_policy="all", second_expert_threshold=0.0)


def test_sampling_policy_draws_the_second_expert_by_gumbel_max_over_the_others():
    # One token, four tied logits: first choice expert 0. Gumbel noise -log(-log u) is largest
    # for expert 0 (masked out: it is the first choice) and next for expert 3.
    uniform = jnp.asarray([[[0.999, 0.1, 0.2, 0.99]]])
    routing = top2_gating(jnp.zeros((1, 1, 4)), 1, second_expert_policy="sampling", second_choice_uniform=uniform)
    np.testing.assert_array_equal(np.asarray(routing.slot_token[0, :, 0]), [0, 1, 1, 0])  # experts 0 and 3
    # Frequencies follow softmax over the remaining experts: logits (2, 1, 0, -1) -> first expert 0,
    # second expert 1, 2, 3 with probability e^1, e^0, e^-1 over their sum.
    logits = jnp.broadcast_to(jnp.asarray([2.0, 1.0, 0.0, -1.0]), (1, 4096, 4))
    routing = top2_gating(logits, 4096, second_expert_policy="sampling", rng=jax.random.key(0))
    second = (np.asarray(routing.slot_token[0, 1:]) < 4096).sum(axis=1) / 4096  # filled slots of experts 1..3
    expected = np.exp([1.0, 0.0, -1.0]) / np.exp([1.0, 0.0, -1.0]).sum()
    np.testing.assert_allclose(second, expected, atol=0.03)
    with pytest.raises(ValueError, match="rng"):
        top2_gating(logits, 4, second_expert_policy="sampling")


def test_renormalising_after_drops_gives_a_kept_choice_the_whole_weight():
    # Capacity 1: pass 1 keeps t0 -> e0, t1 -> e2 (t2, t3 dropped); pass 2 keeps t0 -> e1 only.
    legacy = top2_gating(LOGITS, 1, second_expert_policy="all")
    praxis = top2_gating(LOGITS, 1, second_expert_policy="all", renormalize_after_drops=True)
    np.testing.assert_array_equal(slots(legacy)[0], slots(praxis)[0])
    np.testing.assert_allclose(token_weights(legacy), [1, 0.4 / 0.7, 0, 0], atol=1e-6)  # lost g2 stays lost
    np.testing.assert_allclose(token_weights(praxis), [1, 1, 0, 0], atol=1e-6)
    np.testing.assert_allclose(slots(praxis)[1][:, 0], [0.5 / 0.9, 0.4 / 0.9, 1.0], atol=1e-6)


def test_gating_logit_cap_soft_caps_logits_before_the_softmax():
    logits = jnp.asarray([[[3.0, 0.0, -3.0]]])
    routing = top2_gating(logits, 1, second_expert_policy="all", gating_logit_cap=1.0)
    capped = np.tanh(np.array([3.0, 0.0, -3.0]))  # cap * tanh(logits / cap), cap = 1
    gates = np.exp(capped) / np.exp(capped).sum()  # (0.629, 0.232, 0.139) instead of (0.95, 0.047, 0.002)
    np.testing.assert_allclose(
        np.asarray(routing.slot_weight[0, :2, 0]), gates[:2] / gates[:2].sum(), atol=1e-6
    )
    assert float(routing.metrics["router_z_loss"]) == pytest.approx(np.log(np.exp(capped).sum()) ** 2, rel=1e-5)
    with pytest.raises(ValueError, match="gating_logit_cap"):
        top2_gating(logits, 1, second_expert_policy="all", gating_logit_cap=-1.0)


def test_fprop_and_mask_dtypes():
    reference = top2_gating(LOGITS, 2, second_expert_policy="all")
    routing = top2_gating(LOGITS, 2, second_expert_policy="all", fprop_dtype=jnp.bfloat16, mask_dtype=jnp.int32)
    combine, dispatch, aux, _ = routing
    assert combine.dtype == routing.slot_weight.dtype == jnp.bfloat16 and dispatch.dtype == jnp.int32
    assert aux.dtype == jnp.float32  # losses stay float32
    np.testing.assert_array_equal(np.asarray(dispatch), np.asarray(reference.dispatch_mask).astype(np.int32))
    np.testing.assert_allclose(np.asarray(combine, np.float32), np.asarray(reference.combine_weights), atol=4e-3)


def test_capacity_conventions_carlskit_per_choice_and_praxis_total():
    # carlskit: C = ceil(k S f / E); praxis: floor(S f / E), padded up to a multiple of 4.
    assert expert_capacity(64, 8, 1.0) == 16 and expert_capacity(64, 8, 2.0, convention="praxis") == 16
    assert expert_capacity(10, 3, 1.0) == 7
    assert expert_capacity(10, 3, 2.0, convention="praxis") == 8  # floor(6.67) = 6 -> 8
    assert expert_capacity(4, 8, 1.0, convention="praxis") == 1  # floor(0.5) = 0 -> at least 1
    assert expert_capacity(10, 2, 4.0, convention="praxis") == 20  # not clipped to S
    with pytest.raises(ValueError, match="convention"):
        expert_capacity(10, 2, 1.0, convention="lingvo")
