"""Moving tokens to expert buffers and back: GShard's einsums, or gather / scatter-add.

Both paths compute the same sums (outputs and gradients agree to float rounding):
  dispatch:  expert_in[e, g, c] = sum_s dispatch_mask[g, s, e, c] * x[g, s]
  combine:   y[g, s] = sum_{e, c} combine_weights[g, s, e, c] * expert_out[e, g, c]
The einsum path (GShard 2.2, ``GSEC,GSM->EGCM``) costs O(G S E C M); the gather/scatter path
costs O(G E C M), i.e. it does not grow with S and stays flat in E at fixed E * C.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from carlskit._checks import choice
from carlskit.moe._gating import Routing

DISPATCH_MODES = ("scatter", "einsum")


@jax.jit
def dispatch_einsum(routing: Routing, x: jax.Array) -> jax.Array:
    """[G, S, M] -> [E, G, C, M] by ``einsum('GSEC,GSM->EGCM')``."""
    _check_tokens(routing, x)
    return jnp.einsum("gsec,gsm->egcm", routing.dispatch_mask.astype(x.dtype), x)


@jax.jit
def combine_einsum(routing: Routing, expert_out: jax.Array) -> jax.Array:
    """[E, G, C, M] -> [G, S, M] by ``einsum('GSEC,EGCM->GSM')``."""
    _check_expert_out(routing, expert_out)
    return jnp.einsum("gsec,egcm->gsm", routing.combine_weights.astype(expert_out.dtype), expert_out)


@jax.jit
def dispatch_gather(routing: Routing, x: jax.Array) -> jax.Array:
    """[G, S, M] -> [E, G, C, M] by gathering each slot's token (empty slots read zeros)."""
    _check_tokens(routing, x)
    groups, _, dim = x.shape
    padded = jnp.concatenate([x, jnp.zeros((groups, 1, dim), x.dtype)], axis=1)  # row S = empty
    slots = routing.slot_token.reshape(groups, -1)
    gathered = jnp.take_along_axis(padded, slots[..., None], axis=1)  # [G, E*C, M]
    gathered = gathered.reshape(groups, routing.num_experts, routing.capacity, dim)
    return jnp.swapaxes(gathered, 0, 1)


@jax.jit
def combine_scatter(routing: Routing, expert_out: jax.Array) -> jax.Array:
    """[E, G, C, M] -> [G, S, M] by scatter-adding weighted slot outputs to their tokens."""
    _check_expert_out(routing, expert_out)
    num_experts, groups, capacity, dim = expert_out.shape
    weighted = jnp.swapaxes(expert_out, 0, 1) * routing.slot_weight[..., None].astype(expert_out.dtype)
    weighted = weighted.reshape(groups, num_experts * capacity, dim)
    slots = routing.slot_token.reshape(groups, -1)
    rows = jnp.arange(groups)[:, None]
    out = jnp.zeros((groups, routing.num_tokens + 1, dim), expert_out.dtype).at[rows, slots].add(weighted)
    return out[:, : routing.num_tokens]


def dispatch(routing: Routing, x: jax.Array, mode: str = "scatter") -> jax.Array:
    """Tokens [G, S, M] to expert buffers [E, G, C, M] with the chosen path."""
    _check_mode(mode)
    return dispatch_gather(routing, x) if mode == "scatter" else dispatch_einsum(routing, x)


def combine(routing: Routing, expert_out: jax.Array, mode: str = "scatter") -> jax.Array:
    """Expert buffers [E, G, C, M] back to tokens [G, S, M], weighted by the combine weights."""
    _check_mode(mode)
    return combine_scatter(routing, expert_out) if mode == "scatter" else combine_einsum(routing, expert_out)


def _check_tokens(routing: Routing, x: jax.Array) -> None:
    """Trace-time check: x is [G, S, M] for the routing's G groups of S tokens."""
    expected = (routing.slot_token.shape[0], routing.num_tokens)
    if getattr(x, "ndim", None) != 3 or tuple(x.shape[:2]) != expected:
        raise ValueError(
            f"x must have shape [groups={expected[0]}, group_size={expected[1]}, d_model], "
            f"got {getattr(x, 'shape', type(x))}"
        )


def _check_expert_out(routing: Routing, expert_out: jax.Array) -> None:
    """Trace-time check: expert_out is [E, G, C, M] for the routing's slots."""
    groups, experts, capacity = routing.slot_token.shape
    if getattr(expert_out, "ndim", None) != 4 or tuple(expert_out.shape[:3]) != (experts, groups, capacity):
        raise ValueError(
            f"expert_out must have shape [num_experts={experts}, groups={groups}, capacity={capacity}, d_model], "
            f"got {getattr(expert_out, 'shape', type(expert_out))}"
        )


def _check_mode(mode: str) -> None:
    choice(mode, "dispatch", DISPATCH_MODES)
