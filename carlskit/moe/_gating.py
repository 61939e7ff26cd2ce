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
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from carlskit._checks import positive_float, positive_int

SECOND_EXPERT_POLICIES = ("random", "all", "none")
ROUTERS = ("top2", "top1", "expert_choice")


@dataclasses.dataclass(frozen=True)
class Routing:
    """Result of a router for G groups of S tokens and E experts with capacity C.

    Attributes:
      slot_token: int32 [G, E, C], token index (0..S-1) held by each expert slot, S if empty.
      slot_weight: float32 [G, E, C], combine weight of each slot (0 if empty).
      aux_loss: float32 scalar, load-balancing loss (GShard Algorithm 1 times E**2).
      metrics: dict of float32 arrays (``expert_load`` [E], ``expert_fill`` [E],
        ``dropped_first``, ``dropped_second``, ``dropped_tokens``, ``router_z_loss``).
      num_tokens: S (static).

    Unpacks as ``combine_weights, dispatch_mask, aux_loss, metrics``.
    """

    slot_token: jax.Array
    slot_weight: jax.Array
    aux_loss: jax.Array
    metrics: dict[str, jax.Array]
    num_tokens: int

    @property
    def capacity(self) -> int:
        return self.slot_token.shape[-1]

    @property
    def num_experts(self) -> int:
        return self.slot_token.shape[-2]

    @property
    def dispatch_mask(self) -> jax.Array:
        """bool [G, S, E, C]: token s goes to slot c of expert e."""
        one_hot = self.slot_token[..., None] == jnp.arange(self.num_tokens)  # [G, E, C, S]
        return jnp.transpose(one_hot, (0, 3, 1, 2))

    @property
    def combine_weights(self) -> jax.Array:
        """float32 [G, S, E, C]: weight of slot (e, c) in token s's output."""
        weights = self.dispatch_mask.astype(self.slot_weight.dtype)
        return weights * self.slot_weight[:, None, :, :]

    def __iter__(self) -> Iterator[Any]:
        return iter((self.combine_weights, self.dispatch_mask, self.aux_loss, self.metrics))


jax.tree_util.register_dataclass(
    Routing,
    data_fields=["slot_token", "slot_weight", "aux_loss", "metrics"],
    meta_fields=["num_tokens"],
)


def expert_capacity(group_size: int, num_experts: int, capacity_factor: float, k: int = 2) -> int:
    """Expert buffer size per group: ``C = ceil(k * S * capacity_factor / E)`` (GShard 2.2).

    Rounded up so that ``capacity_factor=1`` fits a perfectly balanced load, at least 1, and at
    most ``S`` (an expert never receives more than S tokens of a group: a token's k choices are
    distinct experts).
    """
    group_size = positive_int(group_size, "group_size")
    num_experts = positive_int(num_experts, "num_experts")
    k = positive_int(k, "k")
    capacity_factor = positive_float(capacity_factor, "capacity_factor")
    capacity = math.ceil(k * group_size * capacity_factor / num_experts - 1e-9)
    return int(min(group_size, max(1, capacity)))


def _check_logits(logits: jax.Array, capacity: int, *, min_experts: int = 1) -> int:
    """Static (trace-time) checks of the router inputs: rank, non-empty dims, capacity."""
    shape = getattr(logits, "shape", None)
    if shape is None or len(shape) != 3 or shape[1] < 1 or shape[2] < min_experts:
        raise ValueError(
            f"logits must have shape [groups, group_size >= 1, num_experts >= {min_experts}], "
            f"got {shape if shape is not None else type(logits).__name__}"
        )
    return positive_int(capacity, "capacity")


def _exclusive_cumsum(mask: jax.Array) -> jax.Array:
    """Position of each token among earlier tokens choosing the same expert: [G, S, E]."""
    return jnp.cumsum(mask, axis=1) - mask


def router_z_loss(logits: jax.Array) -> jax.Array:
    """ST-MoE router z-loss: ``mean(logsumexp(logits, -1) ** 2)`` (Zoph et al. 2022, eq. 5)."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)))


def load_balancing_loss(gates: jax.Array, first_choice_mask: jax.Array) -> jax.Array:
    """GShard auxiliary loss times E**2, averaged over groups.

    ``aux = E**2 * mean_e((count_e / S) * mean_s gates[s, e])`` (GShard Algorithm 1, line 13;
    the paper's ``1/E * sum_e`` scaled by E**2 so a perfectly balanced router scores 1.0).
    ``count_e`` counts first choices of expert e, dropped ones included; it carries no gradient.
    """
    num_experts = gates.shape[-1]
    fraction = jax.lax.stop_gradient(jnp.mean(first_choice_mask, axis=1))  # [G, E]
    mean_gate = jnp.mean(gates, axis=1)  # [G, E]
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


def _choice_routing(
    logits: jax.Array,
    capacity: int,
    *,
    num_choices: int,
    second_expert_policy: str,
    rng: jax.Array | None,
    uniform: jax.Array | None = None,
) -> Routing:
    """Token-choice routing with 1 (Switch) or 2 (GShard) experts per token."""
    capacity = _check_logits(logits, capacity, min_experts=num_choices)  # top-2 needs two distinct experts
    if second_expert_policy not in SECOND_EXPERT_POLICIES:
        raise ValueError(
            f"second_expert_policy must be one of {SECOND_EXPERT_POLICIES}, got {second_expert_policy!r}"
        )
    groups, num_tokens, num_experts = logits.shape
    gates = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)

    index_1 = jnp.argmax(gates, axis=-1)
    mask_1 = jax.nn.one_hot(index_1, num_experts, dtype=jnp.float32)
    gate_1 = jnp.sum(gates * mask_1, axis=-1)
    aux_loss = load_balancing_loss(gates, mask_1)

    # Pass 1: first choices fill buffers in token order; overflow is dropped but counted.
    position_1 = jnp.sum(_exclusive_cumsum(mask_1) * mask_1, axis=-1).astype(jnp.int32)
    keep_1 = position_1 < capacity
    count_1 = jnp.sum(mask_1, axis=1, keepdims=True)  # [G, 1, E], dropped included

    metrics = {
        "expert_load": jnp.mean(mask_1, axis=(0, 1)),
        "dropped_first": jnp.mean(1.0 - keep_1),
        "router_z_loss": router_z_loss(logits),
    }
    if num_choices == 1:
        slot_token, slot_weight = _slots_from_choices(
            index_1, position_1, keep_1, gate_1, num_tokens, num_experts, capacity
        )
        metrics["dropped_second"] = jnp.zeros((), jnp.float32)
        metrics["dropped_tokens"] = metrics["dropped_first"]
    else:
        index_2 = jnp.argmax(gates * (1.0 - mask_1), axis=-1)
        mask_2 = jax.nn.one_hot(index_2, num_experts, dtype=jnp.float32)
        gate_2 = jnp.sum(gates * mask_2, axis=-1)
        denominator = gate_1 + gate_2 + jnp.finfo(jnp.float32).tiny
        gate_1, gate_2 = gate_1 / denominator, gate_2 / denominator
        if second_expert_policy == "all":
            attempt_2 = jnp.ones_like(keep_1)
        elif second_expert_policy == "none":
            attempt_2 = jnp.zeros_like(keep_1)
        else:
            if uniform is None:
                if rng is None:
                    raise ValueError('second_expert_policy="random" needs rng (a jax.random key)')
                uniform = jax.random.uniform(rng, gate_2.shape, jnp.float32)
            elif uniform.shape != gate_2.shape:
                raise ValueError(f"second_choice_uniform must have shape {gate_2.shape}, got {uniform.shape}")
            attempt_2 = 2.0 * jax.lax.stop_gradient(gate_2) > uniform
        # Pass 2: second choices go after *all* first choices of their expert, in token order.
        # A second choice rejected by the policy takes no slot (as in mesh-tensorflow's moe.py).
        mask_2 = mask_2 * attempt_2[..., None]
        position_2 = jnp.sum((_exclusive_cumsum(mask_2) + count_1) * mask_2, axis=-1).astype(jnp.int32)
        keep_2 = attempt_2 & (position_2 < capacity)
        slot_token, slot_weight = _slots_from_choices(
            jnp.concatenate([index_1, index_2], axis=1),
            jnp.concatenate([position_1, position_2], axis=1),
            jnp.concatenate([keep_1, keep_2], axis=1),
            jnp.concatenate([gate_1, gate_2], axis=1),
            num_tokens,
            num_experts,
            capacity,
        )
        metrics["dropped_second"] = jnp.mean(attempt_2 & ~keep_2)
        metrics["dropped_tokens"] = jnp.mean(~keep_1 & ~keep_2)
    metrics["expert_fill"] = jnp.mean(slot_token < num_tokens, axis=(0, 2))
    return Routing(slot_token, slot_weight, aux_loss, metrics, num_tokens)


@functools.partial(jax.jit, static_argnames=("capacity", "second_expert_policy"))
def top2_gating(
    logits: jax.Array,
    capacity: int,
    *,
    second_expert_policy: str = "random",
    rng: jax.Array | None = None,
    second_choice_uniform: jax.Array | None = None,
) -> Routing:
    """GShard group-level top-2 gating (Lepikhin et al. 2020, Algorithm 1).

    gates = softmax(logits) in float32; per token the top-2 experts with g1, g2 renormalised to
    g1 + g2 = 1. Pass 1 puts first choices into each expert's buffer in token order while its
    count is below C (overflow dropped, still counted). Pass 2 places second choices after all
    first choices of that expert, in token order, if they fit and, for policy ``"random"``, only
    if ``2 * g2 > u``, ``u ~ U(0, 1)`` (``"all"`` always tries, ``"none"`` never).

    Args:
      logits: [G, S, E] router logits.
      capacity: C, slots per expert and group (see :func:`expert_capacity`).
      second_expert_policy: "random", "all" or "none".
      rng: jax.random key, required for "random" unless ``second_choice_uniform`` is given.
      second_choice_uniform: optional precomputed u [G, S] (lets sharded callers draw it once
        for the global batch, so results do not depend on the mesh).

    Returns:
      :class:`Routing`; unpacks as ``(combine_weights [G,S,E,C], dispatch_mask [G,S,E,C],
      aux_loss, metrics)``.
    """
    return _choice_routing(
        logits, capacity, num_choices=2, second_expert_policy=second_expert_policy, rng=rng,
        uniform=second_choice_uniform,
    )


@functools.partial(jax.jit, static_argnames=("capacity",))
def top1_gating(logits: jax.Array, capacity: int) -> Routing:
    """Switch Transformer top-1 routing (Fedus et al. 2021, 2.1): weight = gate of the argmax
    expert (not renormalised), tokens over capacity dropped, same aux loss as :func:`top2_gating`."""
    return _choice_routing(logits, capacity, num_choices=1, second_expert_policy="none", rng=None)


@functools.partial(jax.jit, static_argnames=("capacity",))
def expert_choice_gating(logits: jax.Array, capacity: int) -> Routing:
    """Expert-choice routing (Zhou et al. 2022, 3.1): each expert takes the C tokens with the
    highest gate ``softmax(logits)[s, e]``; weight = that gate. Balanced by construction
    (aux loss 0); a token may get zero or several experts."""
    capacity = _check_logits(logits, capacity)
    groups, num_tokens, num_experts = logits.shape
    if capacity > num_tokens:
        raise ValueError(f"capacity must be <= group size {num_tokens} for expert choice, got {capacity}")
    gates = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    slot_weight, slot_token = jax.lax.top_k(jnp.swapaxes(gates, 1, 2), capacity)  # [G, E, C]
    chosen = jnp.zeros((groups, num_tokens + 1), jnp.float32).at[
        jnp.arange(groups)[:, None], slot_token.reshape(groups, -1)
    ].add(1.0)[:, :num_tokens]
    no_expert = jnp.mean(chosen == 0)
    metrics = {
        "expert_load": jnp.full((num_experts,), 1.0 / num_experts, jnp.float32),
        "expert_fill": jnp.ones((num_experts,), jnp.float32),
        "dropped_first": no_expert,
        "dropped_second": jnp.zeros((), jnp.float32),
        "dropped_tokens": no_expert,
        "router_z_loss": router_z_loss(logits),
    }
    return Routing(slot_token.astype(jnp.int32), slot_weight, jnp.zeros((), jnp.float32), metrics, num_tokens)


def route(
    logits: jax.Array,
    capacity: int,
    *,
    router: str = "top2",
    second_expert_policy: str = "random",
    rng: jax.Array | None = None,
    second_choice_uniform: jax.Array | None = None,
) -> Routing:
    """Dispatch to :func:`top2_gating`, :func:`top1_gating` or :func:`expert_choice_gating`."""
    if router == "top2":
        return top2_gating(
            logits, capacity, second_expert_policy=second_expert_policy, rng=rng,
            second_choice_uniform=second_choice_uniform,
        )
    if router == "top1":
        return top1_gating(logits, capacity)
    if router == "expert_choice":
        return expert_choice_gating(logits, capacity)
    raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")


def experts_per_token(router: str) -> int:
    """k: experts each token uses (per-token FLOPs factor) for capacity and dense baselines."""
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
    return 1 if router == "top1" else 2
