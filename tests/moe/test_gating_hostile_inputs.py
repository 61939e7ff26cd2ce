"""The last hostile router inputs (issue 43): a capacity beyond int32 slot indices, and logits that
are NaN or infinite."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from carlskit.moe import expert_choice_gating, top1_gating, top2_gating
from carlskit.moe._dispatch import combine

GROUPS, TOKENS, EXPERTS = 1, 8, 4
NAN_TOKEN, INF_TOKEN = 2, 5


def logits_with_nan_and_inf() -> jax.Array:
    logits = jax.random.normal(jax.random.key(0), (GROUPS, TOKENS, EXPERTS))
    return logits.at[0, NAN_TOKEN, 1].set(jnp.nan).at[0, INF_TOKEN, 0].set(jnp.inf)


def weights_per_token(routing) -> np.ndarray:
    """[S, slots]: each token's slot weights (NaN-aware), from the combine weights."""
    combine_weights = np.asarray(routing.combine_weights)[0].reshape(TOKENS, -1)
    held = np.asarray(routing.dispatch_mask)[0].reshape(TOKENS, -1)
    return np.where(held, combine_weights, 0.0), held


@pytest.mark.parametrize("router", [top2_gating, top1_gating, expert_choice_gating])
def test_a_capacity_beyond_int32_slot_indices_is_a_value_error_naming_capacity_and_the_largest(router):
    logits = jnp.zeros((GROUPS, TOKENS, EXPERTS))
    largest = (2**31 - 2) // EXPERTS
    with pytest.raises(ValueError, match=rf"capacity must be <= {largest} for {EXPERTS} experts"):
        router(logits, 10**9)  # was JAX's OverflowError about "argument path y"


@pytest.mark.parametrize("policy", ["all", "random", "sampling"])
def test_top2_gives_every_slot_of_a_token_with_nan_or_inf_logits_weight_nan_and_the_others_finite(policy):
    routing = top2_gating(logits_with_nan_and_inf(), TOKENS, second_expert_policy=policy, rng=jax.random.key(1))
    weights, held = weights_per_token(routing)
    for token in (NAN_TOKEN, INF_TOKEN):
        assert held[token].sum() == 2, "both choices are placed: the second is never skipped silently"
        assert np.isnan(weights[token][held[token]]).all()
    finite = [token for token in range(TOKENS) if token not in (NAN_TOKEN, INF_TOKEN)]
    assert np.isfinite(weights[finite]).all()  # the NaN stays in its own token's row
    assert np.isnan(routing.aux_loss) and np.isnan(routing.metrics["router_z_loss"])


def test_the_combined_output_is_nan_exactly_for_the_tokens_with_nan_or_inf_logits():
    routing = top2_gating(logits_with_nan_and_inf(), TOKENS, second_expert_policy="all")
    expert_out = jnp.ones((EXPERTS, GROUPS, TOKENS, 3))
    for mode in ("scatter", "einsum"):
        nan_rows = np.isnan(np.asarray(combine(routing, expert_out, mode))[0]).any(axis=-1)
        assert np.flatnonzero(nan_rows).tolist() == [NAN_TOKEN, INF_TOKEN], mode


@pytest.mark.parametrize("router", [top1_gating, expert_choice_gating])
def test_top1_and_expert_choice_give_a_token_with_nan_or_inf_logits_nan_weights_and_a_nan_aux_loss(router):
    routing = router(logits_with_nan_and_inf(), TOKENS // 2)
    weights, held = weights_per_token(routing)
    for token in (NAN_TOKEN, INF_TOKEN):
        assert held[token].any(), "a token with NaN gates is never left without an expert"
        assert np.isnan(weights[token][held[token]]).all()
    assert np.isnan(routing.aux_loss)


def test_a_minus_inf_logit_masks_an_expert_and_routes_normally():
    logits = jax.random.normal(jax.random.key(0), (GROUPS, TOKENS, EXPERTS)).at[:, :, 0].set(-jnp.inf)
    routing = top2_gating(logits, TOKENS, second_expert_policy="all")
    assert np.isfinite(np.asarray(routing.slot_weight)).all() and np.isfinite(routing.aux_loss)
    assert not np.asarray(routing.dispatch_mask)[..., 0, :].any()  # no token goes to the masked expert
