"""Routing (gating) functions for Mixture-of-Experts layers: pure, jit- and vmap-able.

All routers return a :class:`Routing`, held in *slot form*: for every expert buffer slot
``(g, e, c)`` the index of the token that fills it (``slot_token``, ``S`` when empty) and its
combine weight (``slot_weight``, 0 when empty). The GShard tensors ``combine_weights`` and
``dispatch_mask`` ``[G, S, E, C]`` are derived from it on demand, so the scatter/gather dispatch
path never builds them (its cost does not grow with the number of experts at fixed ``E * C``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp

from carlskit._checks import choice, finite_float, integer, positive_float, positive_int

SECOND_EXPERT_POLICIES = ("random", "all", "none", "sampling")
ROUTERS = ("top2", "top1", "expert_choice")
CAPACITY_CONVENTIONS = ("carlskit", "praxis")


@dataclasses.dataclass(frozen=True)
class Routing:
    """Result of a router for G groups of S tokens and E experts with capacity C.

    Attributes:
      slot_token: int32 [G, E, C], token index (0..S-1) held by each expert slot, S if empty.
      slot_weight: [G, E, C] combine weight of each slot (0 if empty), in the router's
        ``fprop_dtype`` (float32 by default).
      aux_loss: float32 scalar, load-balancing loss (GShard Algorithm 1 times E**2).
      metrics: dict of float32 arrays (``expert_load`` [E], ``expert_fill`` [E],
        ``dropped_first``, ``dropped_second``, ``dropped_tokens``, ``router_z_loss``).
      num_tokens: S (static).
      mask_dtype: dtype of :attr:`dispatch_mask` (static; bool by default).

    Unpacks as ``combine_weights, dispatch_mask, aux_loss, metrics``.
    """

    slot_token: jax.Array
    slot_weight: jax.Array
    aux_loss: jax.Array
    metrics: dict[str, jax.Array]
    num_tokens: int
    mask_dtype: Any = jnp.bool_

    @property
    def capacity(self) -> int:
        return self.slot_token.shape[-1]

    @property
    def num_experts(self) -> int:
        return self.slot_token.shape[-2]

    @property
    def dispatch_mask(self) -> jax.Array:
        """[G, S, E, C] in ``mask_dtype``: token s goes to slot c of expert e."""
        one_hot = self.slot_token[..., None] == jnp.arange(self.num_tokens)  # [G, E, C, S]
        return jnp.transpose(one_hot, (0, 3, 1, 2)).astype(self.mask_dtype)

    @property
    def combine_weights(self) -> jax.Array:
        """[G, S, E, C] (dtype of ``slot_weight``): weight of slot (e, c) in token s's output."""
        # where, not a product: a NaN weight (a token with non-finite logits) stays in that token's
        # row; 0 * NaN would have made every token's combine weights NaN.
        return jnp.where(self.dispatch_mask.astype(bool), self.slot_weight[:, None, :, :],
                         jnp.zeros((), self.slot_weight.dtype))

    def top_expert(self) -> jax.Array:
        """int32 [G, S]: each token's expert of largest combine weight (the lowest index on a tie),
        -1 for a token dispatched nowhere (padding, or dropped by every expert it chose).

        For top-1 and top-2 routing with a capacity that drops nothing (C = S) this is the token's
        first choice, ``argmax(softmax(logits))``, read from the slot form (no second router).
        """
        groups, num_experts, capacity = self.slot_token.shape
        rows = jnp.arange(groups)[:, None, None]
        experts = jnp.broadcast_to(jnp.arange(num_experts)[None, :, None], self.slot_token.shape)
        # Empty slots hold token S: they land in a spare row S that is cut off.
        weights = jnp.full((groups, self.num_tokens + 1, num_experts), -jnp.inf, jnp.float32)
        weights = weights.at[rows, self.slot_token, experts].max(self.slot_weight.astype(jnp.float32))
        weights = weights[:, : self.num_tokens]
        dispatched = jnp.any(weights > -jnp.inf, axis=-1)
        return jnp.where(dispatched, jnp.argmax(weights, axis=-1), -1).astype(jnp.int32)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.combine_weights, self.dispatch_mask, self.aux_loss, self.metrics))


jax.tree_util.register_dataclass(
    Routing,
    data_fields=["slot_token", "slot_weight", "aux_loss", "metrics"],
    meta_fields=["num_tokens", "mask_dtype"],
)


def expert_capacity(
    group_size: int, num_experts: int, capacity_factor: float, k: int = 2, *, convention: str = "carlskit"
) -> int:
    """Expert buffer size C per group of S = ``group_size`` tokens, from a capacity factor.

    Two conventions for the factor are in use (GShard 2.2 states ``C = 2S/E`` for top-2):

    - ``"carlskit"`` (default): the factor is *per choice*, ``capacity_factor = E*C / (k*S)``:
      ``C = ceil(k * S * capacity_factor / E)``, rounded up so that ``capacity_factor=1`` fits a
      perfectly balanced load of all k choices, at least 1 and at most S (a token's k choices are
      distinct experts, so an expert never receives more than S tokens of a group).
    - ``"praxis"`` (google/praxis ``top2_gating_on_logits``, lingvo): the factor counts all
      choices together, ``capacity_factor = E*C / S``: ``C = floor(S * capacity_factor / E)``,
      then padded up to a multiple of 4 (TPU tiling) when above 1; ``k`` is not used, so praxis'
      ``capacity_factor=2`` equals carlskit's 1.0 for top-2 (up to the rounding), and C is not
      clipped to S.

    An explicit C can be given to the layers instead (``expert_capacity=`` on
    :class:`~carlskit.moe.MoEFeedForward` / :class:`~carlskit.moe.MoEModel`).

    Example (1024 tokens per group over 8 experts: a balanced top-2 load is 256 per expert)::

        >>> expert_capacity(1024, 8, 1.0)
        256
        >>> expert_capacity(1024, 8, 2.0, convention="praxis")  # praxis counts both choices
        256
        >>> expert_capacity(6, 4, 1.0)  # ceil(2 * 6 / 4)
        3
    """
    group_size = positive_int(group_size, "group_size")
    num_experts = positive_int(num_experts, "num_experts")
    k = positive_int(k, "k")
    capacity_factor = positive_float(capacity_factor, "capacity_factor")
    choice(convention, "convention", CAPACITY_CONVENTIONS)
    if convention == "praxis":
        capacity = int(group_size * capacity_factor / num_experts)
        return max(1, capacity + (-capacity) % 4) if capacity > 1 else 1
    capacity = math.ceil(k * group_size * capacity_factor / num_experts - 1e-9)
    return int(min(group_size, max(1, capacity)))


# Slot indices e * C + c, and the spare slot E * C of dropped choices, are int32: C may be at most
# (2**31 - 2) // E. Beyond that JAX raised an OverflowError about "argument path y" (issue 43); such a
# C could only be a typo (the [G, E, C] buffers would not fit in any memory).
MAX_CAPACITY = 2**31 - 1


def largest_capacity(num_experts: int) -> int:
    """The largest C the routers accept for ``num_experts`` experts: ``(2**31 - 2) // E``."""
    return (MAX_CAPACITY - 1) // num_experts


def _check_logits(logits: jax.Array, capacity: int, *, min_experts: int = 1) -> int:
    """Static (trace-time) checks of the router inputs: rank, non-empty dims, real dtype, capacity."""
    shape = getattr(logits, "shape", None)
    if shape is None or len(shape) != 3 or shape[1] < 1 or shape[2] < min_experts:
        raise ValueError(
            f"logits must have shape [groups, group_size >= 1, num_experts >= {min_experts}], "
            f"got {shape if shape is not None else type(logits).__name__}"
        )
    kind = jnp.dtype(logits.dtype).kind
    if kind not in "iuf" and not jnp.issubdtype(logits.dtype, jnp.floating):  # bfloat16 has kind "V"
        raise TypeError(f"logits must be a real-valued array [groups, group_size, num_experts], got dtype "
                        f"{logits.dtype}")
    num_experts = shape[2]
    return integer(capacity, "capacity", 1, largest_capacity(num_experts),
                   why=f" for {num_experts} experts (slot indices up to E * C are int32)")


def _checked_at_the_boundary(routing: Callable) -> Callable:
    """``routing`` (a jitted router) with its array arguments checked before ``jax.jit`` sees them:
    jit would refuse a string ``logits`` or ``rng`` with "Error interpreting argument ... as an
    abstract array", and a malformed key with "invalid PRNG key data"; here the error names the
    argument. The dtype and shape checks of :func:`_check_logits` run at trace time."""

    @functools.wraps(routing)
    def checked(logits: Any, *args: Any, **kwargs: Any) -> Routing:
        if not hasattr(logits, "shape") or not hasattr(logits, "dtype"):
            raise TypeError(f"logits must be an array [groups, group_size, num_experts], got "
                            f"{type(logits).__name__}")
        if kwargs.get("rng") is not None:
            _check_rng(kwargs["rng"])
        return routing(logits, *args, **kwargs)

    return checked


def _check_rng(rng: Any) -> None:
    """One jax.random key: a typed key of shape () or raw key data (uint32, the default impl's shape)."""
    dtype, shape = getattr(rng, "dtype", None), getattr(rng, "shape", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        if shape != ():
            raise ValueError(f"rng must be one jax.random key (shape ()), got a key array of shape {shape}")
        return
    raw_shape = jax.random.key_data(jax.random.key(0)).shape
    if dtype is None or jnp.dtype(dtype) != jnp.uint32 or tuple(shape) != raw_shape:
        described = type(rng).__name__ if dtype is None else f"dtype {dtype}, shape {tuple(shape)}"
        raise TypeError(f"rng must be one jax.random key (jax.random.key(seed), or PRNGKey raw data of "
                        f"dtype uint32 and shape {raw_shape}), got {described}")


def _token_masks(
    logits: jax.Array, paddings: jax.Array | None, importance: jax.Array | None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """bool [G, S] masks: real (not padded) tokens, tokens that may take a first and a second choice.

    praxis semantics: ``importance == 1`` tokens take a first choice, ``importance > 0`` a second.
    """
    token_shape = tuple(logits.shape[:2])
    for name, value in (("paddings", paddings), ("importance", importance)):
        if value is not None and tuple(getattr(value, "shape", ())) != token_shape:
            raise ValueError(f"{name} must have shape [groups, group_size] = {token_shape}, "
                             f"got {getattr(value, 'shape', type(value))}")
    valid = jnp.ones(token_shape, bool) if paddings is None else jnp.asarray(paddings) == 0
    first_ok, second_ok = valid, valid
    if importance is not None:
        importance = jnp.asarray(importance, jnp.float32)
        first_ok = first_ok & (importance == 1.0)
        second_ok = second_ok & (importance > 0.0)
    return valid, first_ok, second_ok


def _masked_mean(values: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
    """Mean of ``values`` over the entries where ``mask`` is set (0 when none is)."""
    mask = mask.astype(jnp.float32)
    return jnp.sum(values * mask, axis=axis) / jnp.maximum(jnp.sum(mask, axis=axis), 1.0)


def _nonfinite_tokens(gates: jax.Array) -> jax.Array:
    """bool [G, S]: tokens whose gates are NaN (a NaN or +inf logit, or every logit -inf).

    Such a token routes as "every output NaN" (issue 43): each slot it holds gets weight NaN, its
    second choice is always attempted, and the aux loss and z-loss are NaN. Before, its weights
    were NaN for some slots and its second choice was silently skipped, so 6 of 8 tokens looked
    fine; in expert choice, a token whose softmax gave -NaN was chosen by no expert at all.
    """
    return jnp.any(jnp.isnan(gates), axis=-1)


def _exclusive_cumsum(mask: jax.Array) -> jax.Array:
    """Position of each token among earlier tokens choosing the same expert: [G, S, E]."""
    return jnp.cumsum(mask, axis=1) - mask


def _cap_logits(logits: jax.Array, gating_logit_cap: float) -> jax.Array:
    """float32 logits, soft-capped to ``cap * tanh(logits / cap)`` when ``gating_logit_cap > 0``."""
    logits = logits.astype(jnp.float32)
    if gating_logit_cap > 0:
        logits = gating_logit_cap * jnp.tanh(logits / gating_logit_cap)
    return logits


def router_z_loss(logits: jax.Array, paddings: jax.Array | None = None) -> jax.Array:
    """ST-MoE router z-loss: ``mean(logsumexp(logits, -1) ** 2)`` (Zoph et al. 2022, eq. 5),
    the mean over the tokens that are not padding (``paddings`` [G, S], 1 = padding)."""
    z = jnp.square(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1))
    if paddings is None:
        return jnp.mean(z)
    return _masked_mean(z, jnp.asarray(paddings) == 0)


def load_balancing_loss(
    gates: jax.Array, first_choice_mask: jax.Array, token_mask: jax.Array | None = None
) -> jax.Array:
    """GShard auxiliary loss times E**2, averaged over groups.

    ``aux = E**2 * mean_e((count_e / S) * mean_s gates[s, e])`` (GShard Algorithm 1, line 13;
    the paper's ``1/E * sum_e`` scaled by E**2 so a perfectly balanced router scores 1.0).
    ``count_e`` counts first choices of expert e, dropped ones included; it carries no gradient.
    With ``token_mask`` [G, S] (bool), S and both means run over the masked tokens only (padding
    and tokens of importance != 1 are left out, as in praxis with ``legacy_mtf_behavior=False``).
    """
    num_experts = gates.shape[-1]
    if token_mask is None:
        token_mask = jnp.ones(gates.shape[:2], bool)
    mask = token_mask[..., None]
    fraction = jax.lax.stop_gradient(_masked_mean(first_choice_mask * mask, mask, axis=1))  # [G, E]
    mean_gate = _masked_mean(gates, jnp.broadcast_to(mask, gates.shape), axis=1)  # [G, E]
    return num_experts**2 * jnp.mean(fraction * mean_gate)


def _slots_from_choices(
    expert_index: jax.Array,  # [G, K*S] int
    position: jax.Array,  # [G, K*S] int
    keep: jax.Array,  # [G, K*S] bool
    weight: jax.Array,  # [G, K*S] float
    num_tokens: int,
    num_experts: int,
    capacity: int,
) -> tuple[jax.Array, jax.Array]:
    """Scatter token choices into slot form (one int scatter, no [G, S, E, C] tensor)."""
    groups, num_assignments = expert_index.shape
    num_slots = num_experts * capacity
    flat_slot = jnp.where(keep, expert_index * capacity + position, num_slots)  # dropped -> spare slot
    rows = jnp.arange(groups)[:, None]
    assignment = jnp.broadcast_to(jnp.arange(num_assignments, dtype=jnp.int32), (groups, num_assignments))
    # Integer scatter (no gradient) of which assignment holds each slot; weights are then gathered,
    # whose gradient is a cheap scatter-add (a float scatter-set would need a costly JVP rule).
    slot_assignment = jnp.full((groups, num_slots + 1), num_assignments, jnp.int32)
    slot_assignment = slot_assignment.at[rows, flat_slot].set(assignment)[:, :num_slots]
    empty = slot_assignment == num_assignments
    slot_token = jnp.where(empty, num_tokens, slot_assignment % num_tokens)
    padded_weight = jnp.concatenate([weight, jnp.zeros((groups, 1), weight.dtype)], axis=1)
    slot_weight = jnp.take_along_axis(padded_weight, slot_assignment, axis=1)
    shape = (groups, num_experts, capacity)
    return slot_token.reshape(shape), slot_weight.reshape(shape)


def _normalize_pair(gate_1: jax.Array, gate_2: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``g / (g1 + g2)`` for both gates; (0, 0) where both are 0."""
    denominator = gate_1 + gate_2
    denominator = jnp.where(denominator > 0, denominator, 1.0)
    return gate_1 / denominator, gate_2 / denominator


def _second_choice(
    logits: jax.Array, first_one_hot: jax.Array, index_1: jax.Array, noise: jax.Array | None
) -> jax.Array:
    """Index [G, S] of the second expert, never the first one.

    Chosen on the logits with the first expert masked out, not on the gates: when the softmax
    underflows (a gap of ~100 in float32) every other gate is exactly 0, and ``argmax`` of the
    masked gates would return expert 0, possibly the first choice again. With ``noise`` (Gumbel,
    policy "sampling") the argmax is a draw from ``softmax`` over the remaining experts.
    """
    scores = logits if noise is None else logits + noise
    scores = jnp.where(first_one_hot > 0, -jnp.inf, scores)
    index_2 = jnp.argmax(scores, axis=-1)
    # Only if every other score is -inf or NaN can argmax land on the first expert: take any other.
    num_experts = logits.shape[-1]
    return jnp.where(index_2 == index_1, (index_1 + 1) % num_experts, index_2)


def _choice_routing(
    logits: jax.Array,
    capacity: int,
    *,
    num_choices: int,
    second_expert_policy: str,
    rng: jax.Array | None,
    uniform: jax.Array | None = None,
    paddings: jax.Array | None = None,
    importance: jax.Array | None = None,
    second_expert_threshold: float = 0.5,
    gating_logit_cap: float = 0.0,
    renormalize_after_drops: bool = False,
    fprop_dtype: Any = jnp.float32,
    mask_dtype: Any = jnp.bool_,
) -> Routing:
    """Token-choice routing with 1 (Switch) or 2 (GShard) experts per token (see top2_gating)."""
    capacity = _check_logits(logits, capacity, min_experts=num_choices)  # top-2 needs two distinct experts
    choice(second_expert_policy, "second_expert_policy", SECOND_EXPERT_POLICIES)
    second_expert_threshold = positive_float(second_expert_threshold, "second_expert_threshold")
    gating_logit_cap = finite_float(gating_logit_cap, "gating_logit_cap", minimum=0.0)
    num_tokens = logits.shape[1]
    valid, first_ok, second_ok = _token_masks(logits, paddings, importance)
    logits = _cap_logits(logits, gating_logit_cap)
    gates = jax.nn.softmax(logits, axis=-1)
    first = _first_choices(gates, first_ok, capacity)
    aux_loss = load_balancing_loss(gates, first.mask, first_ok)
    metrics = {
        "expert_load": _masked_mean(first.mask, jnp.broadcast_to(first_ok[..., None], first.mask.shape), axis=(0, 1)),
        "dropped_first": _masked_mean(first_ok & ~first.keep, valid),
        "router_z_loss": _masked_mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)), valid),
    }
    if num_choices == 1:
        slot_token, slot_weight = _slots_from_choices(
            first.index, first.position, first.keep, first.gate, num_tokens, logits.shape[-1], capacity
        )
        metrics["dropped_second"] = jnp.zeros((), jnp.float32)
        metrics["dropped_tokens"] = _masked_mean(~first.keep, valid)
    else:
        uniform = _second_choice_uniform(second_expert_policy, logits.shape, uniform, rng)
        slot_token, slot_weight, dropped_second, kept = _with_second_choices(
            logits, gates, first, second_ok & _nonfinite_tokens(gates), second_ok, capacity, second_expert_policy,
            uniform, second_expert_threshold, renormalize_after_drops,
        )
        metrics["dropped_second"] = _masked_mean(dropped_second, valid)
        metrics["dropped_tokens"] = _masked_mean(~first.keep & ~kept, valid)
    metrics["expert_fill"] = jnp.mean(slot_token < num_tokens, axis=(0, 2))
    return Routing(slot_token, slot_weight.astype(fprop_dtype), aux_loss, metrics, num_tokens, mask_dtype)


class _FirstChoices(NamedTuple):
    """Each token's first expert (``index`` [G, S], ``one_hot`` and ``mask`` [G, S, E]), its gate,
    buffer ``position``, whether it is kept within capacity, and every expert's first-choice
    ``count`` [G, 1, E] (dropped included): where the second choices start."""

    index: jax.Array
    one_hot: jax.Array
    mask: jax.Array
    gate: jax.Array
    position: jax.Array
    keep: jax.Array
    count: jax.Array


def _first_choices(gates: jax.Array, first_ok: jax.Array, capacity: int) -> _FirstChoices:
    """Pass 1: first choices fill buffers in token order; overflow is dropped but counted."""
    index_1 = jnp.argmax(gates, axis=-1)
    one_hot_1 = jax.nn.one_hot(index_1, gates.shape[-1], dtype=jnp.float32)
    mask_1 = one_hot_1 * first_ok[..., None]  # padded / unimportant tokens take no first choice
    gate_1 = jnp.sum(gates * mask_1, axis=-1)
    position_1 = jnp.sum(_exclusive_cumsum(mask_1) * mask_1, axis=-1).astype(jnp.int32)
    keep_1 = first_ok & (position_1 < capacity)
    count_1 = jnp.sum(mask_1, axis=1, keepdims=True)  # [G, 1, E], dropped included
    return _FirstChoices(index_1, one_hot_1, mask_1, gate_1, position_1, keep_1, count_1)


def _second_choice_uniform(second_expert_policy: str, logits_shape: tuple[int, ...], uniform: jax.Array | None,
                           rng: jax.Array | None) -> jax.Array | None:
    """The uniform draws of policy "random" ([G, S]) or "sampling" ([G, S, E]): ``uniform`` if
    given (checked), else drawn from ``rng``; None for the other policies."""
    if second_expert_policy not in ("random", "sampling"):
        return None
    groups, num_tokens, num_experts = logits_shape
    shape = (groups, num_tokens) + ((num_experts,) if second_expert_policy == "sampling" else ())
    if uniform is None:
        if rng is None:
            raise ValueError(f'second_expert_policy="{second_expert_policy}" needs rng (a jax.random key)')
        return jax.random.uniform(rng, shape, jnp.float32)
    if tuple(uniform.shape) != shape:
        raise ValueError(f"second_choice_uniform must have shape {shape}, got {uniform.shape}")
    return uniform


def _with_second_choices(
    logits: jax.Array, gates: jax.Array, first: _FirstChoices, nonfinite: jax.Array, second_ok: jax.Array,
    capacity: int, second_expert_policy: str, uniform: jax.Array | None, second_expert_threshold: float,
    renormalize_after_drops: bool,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """GShard Algorithm 1's second expert: the slots of both choices, and per token whether its
    second choice was attempted but dropped, and whether it was kept. A ``nonfinite`` token's
    (NaN gates) second choice is attempted whatever its gate, so it carries its NaN weight."""
    num_tokens, num_experts = logits.shape[1:]
    noise = -jnp.log(-jnp.log(uniform)) if second_expert_policy == "sampling" else None  # standard Gumbel(0, 1)
    index_2 = _second_choice(logits, first.one_hot, first.index, noise)
    mask_2 = jax.nn.one_hot(index_2, num_experts, dtype=jnp.float32)
    gate_1, gate_2 = first.gate, jnp.sum(gates * mask_2, axis=-1) * second_ok
    if not renormalize_after_drops:  # GShard / mesh-tensorflow: normalise before capacity
        gate_1, gate_2 = _normalize_pair(gate_1, gate_2)
    # A second choice whose gate is 0 (underflow, padding) would add nothing but take a slot.
    attempt_2 = second_ok & (gate_2 > 0)
    if second_expert_policy == "none":
        attempt_2 = jnp.zeros_like(attempt_2)
    elif second_expert_policy == "random":  # GShard: 2 * g2 > u, i.e. u < g2 / 0.5
        attempt_2 = attempt_2 & (uniform < jax.lax.stop_gradient(gate_2) / second_expert_threshold)
    if second_expert_policy != "none":
        attempt_2 = attempt_2 | nonfinite  # NaN > 0 is False: it would have been skipped silently
    # Pass 2: second choices go after *all* first choices of their expert, in token order.
    # A second choice rejected by the policy takes no slot (as in mesh-tensorflow's moe.py).
    mask_2 = mask_2 * attempt_2[..., None]
    position_2 = jnp.sum((_exclusive_cumsum(mask_2) + first.count) * mask_2, axis=-1).astype(jnp.int32)
    keep_2 = attempt_2 & (position_2 < capacity)
    if renormalize_after_drops:  # praxis legacy_mtf_behavior=False: kept gates sum to 1
        gate_1, gate_2 = _normalize_pair(gate_1 * first.keep, gate_2 * keep_2)
    slot_token, slot_weight = _slots_from_choices(
        jnp.concatenate([first.index, index_2], axis=1),
        jnp.concatenate([first.position, position_2], axis=1),
        jnp.concatenate([first.keep, keep_2], axis=1),
        jnp.concatenate([gate_1, gate_2], axis=1),
        num_tokens,
        num_experts,
        capacity,
    )
    return slot_token, slot_weight, attempt_2 & ~keep_2, keep_2


_ROUTING_STATICS = (
    "capacity", "second_expert_policy", "second_expert_threshold", "gating_logit_cap",
    "renormalize_after_drops", "fprop_dtype", "mask_dtype",
)


@_checked_at_the_boundary
@functools.partial(jax.jit, static_argnames=_ROUTING_STATICS)
def top2_gating(
    logits: jax.Array,
    capacity: int,
    *,
    second_expert_policy: str = "random",
    rng: jax.Array | None = None,
    second_choice_uniform: jax.Array | None = None,
    paddings: jax.Array | None = None,
    importance: jax.Array | None = None,
    second_expert_threshold: float = 0.5,
    gating_logit_cap: float = 0.0,
    renormalize_after_drops: bool = False,
    fprop_dtype: Any = jnp.float32,
    mask_dtype: Any = jnp.bool_,
) -> Routing:
    """GShard group-level top-2 gating (Lepikhin et al. 2020, Algorithm 1).

    gates = softmax(logits) in float32; per token the first expert is ``argmax(gates)`` and the
    second is the argmax with the first masked out (always a different expert, even when the
    softmax underflows to exact zeros or gates tie), with g1, g2 renormalised to g1 + g2 = 1.
    Pass 1 puts first choices into each expert's buffer in token order while its count is below
    C (overflow dropped, still counted). Pass 2 places second choices after all first choices of
    that expert, in token order, if they fit and the policy attempts them. A second choice whose
    gate is exactly 0 is never attempted (it would add nothing and take a slot), so every kept
    token's weights sum to 1 unless one of its choices was dropped for capacity.

    Options, with their counterpart in praxis ``gshard_utils.top2_gating_on_logits`` (and lingvo's
    ``Top2GatingOnLogits``, the GShard paper's code):

    - ``second_expert_policy``: ``"random"`` (GShard 2.2: attempt the second choice if
      ``u < g2 / second_expert_threshold``, u ~ U(0, 1)), ``"all"`` (always attempt), ``"none"``
      (top-1 dispatch with top-2 weights), ``"sampling"`` (praxis "sampling": the second expert is
      *drawn* from softmax over the other experts with the Gumbel-max trick,
      ``argmax(logits + G)``, G ~ Gumbel(0, 1), first expert masked; then always attempted).
    - ``second_expert_threshold``: praxis' name; the 0.5 of GShard's ``2 * g2 > u`` (``"random"``).
    - ``paddings`` [G, S] (1 = padding, praxis ``paddings``): padded tokens get no expert, take no
      capacity (later tokens move up), and are left out of the aux loss, the z-loss and the drop
      metrics (their means run over the real tokens).
    - ``importance`` [G, S] (praxis ``importance``): a token takes a first choice only if its
      importance is exactly 1 and a second choice only if it is > 0; tokens of importance != 1
      are left out of the aux loss. (praxis ignores ``paddings`` for the first choice once
      ``importance`` is given; here both apply.)
    - ``renormalize_after_drops`` (praxis ``legacy_mtf_behavior=False``): g1, g2 are left raw
      through the capacity passes and the *kept* ones are renormalised to sum to 1 afterwards,
      so a token that lost one choice to capacity gives full weight to the other. Default False
      is GShard Algorithm 1 / mesh-tensorflow (``legacy_mtf_behavior=True``): normalise first,
      a lost choice's weight is lost. As in praxis, the ``"random"`` test then uses the raw g2.
    - ``gating_logit_cap`` (praxis ``gating_logit_cap``): if > 0, logits become
      ``cap * tanh(logits / cap)`` before the softmax (and the z-loss), bounding them.
    - ``fprop_dtype`` (praxis ``fprop_dtype``): dtype of the combine weights (``slot_weight``),
      e.g. bfloat16; the router itself always computes in float32 (praxis upcasts too).
    - ``mask_dtype`` (praxis ``mask_dtype``): dtype of ``dispatch_mask`` (default bool).

    Where carlskit differs from praxis: capacity is a given C (see :func:`expert_capacity` for both
    factor conventions); first choices dropped for capacity still count towards the positions of
    second choices (Algorithm 1 line 6; praxis counts kept ones only); the aux loss always averages
    over the real tokens (praxis only with ``legacy_mtf_behavior=False``); and a zero-gate second
    choice takes no slot (praxis reserves one and dispatches nothing into it).

    ``paddings``, ``importance``, ``second_expert_threshold``, ``gating_logit_cap``,
    ``renormalize_after_drops``, ``fprop_dtype`` and ``mask_dtype`` are described above.

    Non-finite logits are not checked (a check inside jit would need a transfer to the host each
    step); they make every output of their token NaN instead, so nothing downstream looks fine: a
    token whose gates are NaN (a NaN or ``+inf`` logit, or all ``-inf``) gets weight NaN in every
    slot it holds, its second choice is always attempted (unless the policy is ``"none"``), and
    ``aux_loss`` and ``router_z_loss`` are NaN; other tokens keep finite weights. A ``-inf`` logit
    alone masks its expert. The same holds for :func:`top1_gating` and :func:`expert_choice_gating`
    (which gives such a token to every expert).

    Args:
      logits: [G, S, E] router logits (any float dtype; upcast to float32).
      capacity: C, slots per expert and group (see :func:`expert_capacity`), at most
        ``(2**31 - 2) // E`` (slot indices are int32; :func:`largest_capacity`).
      second_expert_policy: "random", "all", "none" or "sampling".
      rng: jax.random key, required for "random" and "sampling" unless ``second_choice_uniform``
        is given.
      second_choice_uniform: optional precomputed u ~ U(0, 1): [G, S] for "random", [G, S, E] for
        "sampling" (lets sharded callers draw it once for the global batch, so results do not
        depend on the mesh).

    Returns:
      :class:`Routing`; unpacks as ``(combine_weights [G,S,E,C], dispatch_mask [G,S,E,C],
      aux_loss, metrics)``.
    """
    return _choice_routing(
        logits, capacity, num_choices=2, second_expert_policy=second_expert_policy, rng=rng,
        uniform=second_choice_uniform, paddings=paddings, importance=importance,
        second_expert_threshold=second_expert_threshold, gating_logit_cap=gating_logit_cap,
        renormalize_after_drops=renormalize_after_drops, fprop_dtype=fprop_dtype, mask_dtype=mask_dtype,
    )


@_checked_at_the_boundary
@functools.partial(jax.jit, static_argnames=("capacity", "gating_logit_cap", "fprop_dtype", "mask_dtype"))
def top1_gating(
    logits: jax.Array,
    capacity: int,
    *,
    paddings: jax.Array | None = None,
    importance: jax.Array | None = None,
    gating_logit_cap: float = 0.0,
    fprop_dtype: Any = jnp.float32,
    mask_dtype: Any = jnp.bool_,
) -> Routing:
    """Switch Transformer top-1 routing (Fedus et al. 2021, 2.1): weight = gate of the argmax
    expert (not renormalised), tokens over capacity dropped, same aux loss and options
    (``paddings``, ``importance``, ``gating_logit_cap``, dtypes) as :func:`top2_gating`."""
    return _choice_routing(
        logits, capacity, num_choices=1, second_expert_policy="none", rng=None, paddings=paddings,
        importance=importance, gating_logit_cap=gating_logit_cap, fprop_dtype=fprop_dtype, mask_dtype=mask_dtype,
    )


@_checked_at_the_boundary
@functools.partial(jax.jit, static_argnames=("capacity", "gating_logit_cap", "fprop_dtype", "mask_dtype"))
def expert_choice_gating(
    logits: jax.Array,
    capacity: int,
    *,
    paddings: jax.Array | None = None,
    gating_logit_cap: float = 0.0,
    fprop_dtype: Any = jnp.float32,
    mask_dtype: Any = jnp.bool_,
) -> Routing:
    """Expert-choice routing (Zhou et al. 2022, 3.1): each expert takes the C tokens with the
    highest gate ``softmax(logits)[s, e]``; weight = that gate. Balanced by construction
    (aux loss 0); a token may get zero or several experts. Padded tokens (``paddings`` [G, S],
    1 = padding) are never chosen: a slot that only padding could fill stays empty."""
    capacity = _check_logits(logits, capacity)
    gating_logit_cap = finite_float(gating_logit_cap, "gating_logit_cap", minimum=0.0)
    groups, num_tokens, num_experts = logits.shape
    if capacity > num_tokens:
        raise ValueError(f"capacity must be <= group size {num_tokens} for expert choice, got {capacity}")
    valid, _, _ = _token_masks(logits, paddings, None)
    logits = _cap_logits(logits, gating_logit_cap)
    gates = jax.nn.softmax(logits, axis=-1)
    nonfinite = _nonfinite_tokens(gates) & valid
    scores = jnp.where(valid[..., None], gates, -1.0)  # gates >= 0 > -1: padding ranks last
    # A token with NaN gates ranks first for every expert (top_k puts -NaN last, so a softmax that
    # gave -NaN left the token with no expert at all), and its slots get weight NaN.
    scores = jnp.where(nonfinite[..., None], jnp.inf, scores)
    slot_weight, slot_token = jax.lax.top_k(jnp.swapaxes(scores, 1, 2), capacity)  # [G, E, C]
    empty = slot_weight < 0
    slot_token = jnp.where(empty, num_tokens, slot_token)
    slot_weight = jnp.where(empty, 0.0, jnp.where(slot_weight == jnp.inf, jnp.nan, slot_weight))
    chosen = jnp.zeros((groups, num_tokens + 1), jnp.float32).at[
        jnp.arange(groups)[:, None], slot_token.reshape(groups, -1)
    ].add(1.0)[:, :num_tokens]
    no_expert = _masked_mean(chosen == 0, valid)
    metrics = {
        "expert_load": jnp.full((num_experts,), 1.0 / num_experts, jnp.float32),
        "expert_fill": jnp.mean(~empty, axis=(0, 2)).astype(jnp.float32),
        "dropped_first": no_expert,
        "dropped_second": jnp.zeros((), jnp.float32),
        "dropped_tokens": no_expert,
        "router_z_loss": _masked_mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)), valid),
    }
    aux_loss = jnp.where(jnp.any(nonfinite), jnp.nan, 0.0).astype(jnp.float32)  # balanced: 0, unless NaN in
    return Routing(
        slot_token.astype(jnp.int32), slot_weight.astype(fprop_dtype), aux_loss, metrics, num_tokens, mask_dtype,
    )


def route(logits: jax.Array, capacity: int, *, router: str = "top2", **options: Any) -> Routing:
    """Dispatch to :func:`top2_gating`, :func:`top1_gating` or :func:`expert_choice_gating`.

    ``options`` are passed on; the options only top-2 has (second-expert policy, threshold,
    ``rng``, ``second_choice_uniform``, ``renormalize_after_drops``) are dropped for the others,
    and ``importance`` for expert choice.
    """
    if choice(router, "router", ROUTERS) == "top2":
        return top2_gating(logits, capacity, **options)
    top2_only = ("second_expert_policy", "second_expert_threshold", "rng", "second_choice_uniform",
                 "renormalize_after_drops")
    options = {k: v for k, v in options.items() if k not in top2_only}
    if router == "top1":
        return top1_gating(logits, capacity, **options)
    options.pop("importance", None)  # router == "expert_choice"
    return expert_choice_gating(logits, capacity, **options)


def experts_per_token(router: str) -> int:
    """k: experts each token uses (per-token FLOPs factor) for capacity and dense baselines."""
    choice(router, "router", ROUTERS)
    return 1 if router == "top1" else 2
