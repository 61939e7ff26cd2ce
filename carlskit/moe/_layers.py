"""Flax NNX layers: dense FFN, MoE FFN (GShard 2.2), causal self-attention, Transformer block."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from carlskit._checks import boolean, choice, finite_float, positive_float, positive_int
from carlskit.moe._dispatch import DISPATCH_MODES, combine, dispatch
from carlskit.moe._gating import (
    ROUTERS,
    SECOND_EXPERT_POLICIES,
    Routing,
    expert_capacity,
    experts_per_token,
    route,
)
from carlskit.moe._sharding import DATA_AXIS, EXPERT_AXIS, split

# Activations (groups / batch) are split over every device of the mesh; experts over "expert".
BATCH_AXES = (DATA_AXIS, EXPERT_AXIS)


FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _dtype(value: Any, name: str, *, allow_bool: bool = False) -> Any:
    """A float dtype (bfloat16, float16, float32; bool too for masks) or ValueError naming ``name``."""
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        raise TypeError(f"{name} must be a dtype, got {value!r}") from None
    allowed = [jnp.dtype(d) for d in FLOAT_DTYPES] + ([jnp.dtype(jnp.bool_), jnp.dtype(jnp.int32)]
                                                      if allow_bool else [])
    if dtype not in allowed:
        raise ValueError(f"{name} must be one of {[str(d) for d in allowed]}, got {dtype}")
    return dtype.type


def _scaled_normal(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int) -> nnx.Param:
    """Parameter ~ N(0, 1 / fan_in) (LeCun normal).

    Drawn with NumPy from a seed taken off ``rngs.params()``: deterministic for a given seed
    (hence identical with or without a mesh) and free of per-shape XLA compilations, which
    dominate model construction time on CPU.
    """
    seed = np.asarray(jax.random.key_data(rngs.params())).ravel()
    values = np.random.default_rng(seed.astype(np.uint64)).standard_normal(shape, dtype=np.float32)
    return nnx.Param(jnp.asarray(values / np.float32(math.sqrt(fan_in))))


class FeedForward(nnx.Module):
    """Dense position-wise FFN ``relu(x @ wi) @ wo`` (Vaswani et al. 2017, 3.3; no biases)."""

    def __init__(self, d_model: int, hidden_dim: int, *, rngs: nnx.Rngs):
        self.wi = _scaled_normal(rngs, (d_model, hidden_dim), d_model)
        self.wo = _scaled_normal(rngs, (hidden_dim, d_model), hidden_dim)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.relu(x @ self.wi[...].astype(x.dtype)) @ self.wo[...].astype(x.dtype)


class MoEFeedForward(nnx.Module):
    """GShard MoE layer: E expert FFNs, a router, dispatch to capacity-C buffers and combine.

    ``y_s = sum_e combine[s, e, c] * FFN_e(x_s)`` over the slots token s was dispatched to
    (GShard 2.2, eq. 1-2). Tokens [B, L, M] are cut into G groups of S = ``group_size`` tokens
    (default: one group per sequence). ``dispatch="scatter"`` (gather / scatter-add) and
    ``"einsum"`` (``GSEC,GSM->EGCM`` and back) give identical results. With a ``mesh``, groups are
    split over all devices and experts over the "expert" axis, so the dispatch is an all-to-all.

    Gating options (``second_expert_threshold``, ``gating_logit_cap``, ``renormalize_after_drops``,
    ``mask_dtype``) are those of :func:`~carlskit.moe.top2_gating`. ``expert_capacity`` gives C
    directly (else C comes from ``capacity_factor``, see :func:`~carlskit.moe.expert_capacity`).
    ``fprop_dtype`` (default: the input's dtype) is the dtype of the combine weights, the expert
    buffers and the expert FFNs; parameters keep their own dtype and are cast on use. Call with
    ``paddings`` [B, L] (1 = padding) to route padded tokens nowhere (their output is 0), and with
    ``importance`` [B, L] (praxis: a token takes a first choice only at importance 1 and a second
    only above 0, so importance 0 routes it nowhere; ignored by expert choice), and with ``capacity``
    to override C for one call (C = S: no token dropped, as decoding needs).

    Returns ``(y [B, L, M], routing)``; ``routing.aux_loss`` and ``routing.metrics`` carry the
    balancing loss and drop statistics.
    """

    def __init__(
        self,
        d_model: int,
        hidden_dim: int,
        num_experts: int,
        *,
        capacity_factor: float = 2.0,
        expert_capacity: int | None = None,
        router: str = "top2",
        second_expert_policy: str = "random",
        second_expert_threshold: float = 0.5,
        gating_logit_cap: float = 0.0,
        renormalize_after_drops: bool = False,
        fprop_dtype: Any = None,
        mask_dtype: Any = jnp.bool_,
        dispatch: str = "scatter",
        group_size: int | None = None,
        mesh: Mesh | None = None,
        rngs: nnx.Rngs,
    ):
        choice(router, "router", ROUTERS)
        choice(second_expert_policy, "second_expert_policy", SECOND_EXPERT_POLICIES)
        choice(dispatch, "dispatch", DISPATCH_MODES)
        num_experts = positive_int(num_experts, "num_experts")
        capacity_factor = positive_float(capacity_factor, "capacity_factor")
        if group_size is not None:
            group_size = positive_int(group_size, "group_size")
        if router == "top2" and num_experts < 2:
            raise ValueError('router="top2" needs num_experts >= 2 (two distinct experts per token), got 1')
        if mesh is not None and num_experts % mesh.shape.get(EXPERT_AXIS, 1):
            raise ValueError(
                f"num_experts={num_experts} must be divisible by the mesh's expert axis {mesh.shape[EXPERT_AXIS]}"
            )
        if expert_capacity is not None:
            expert_capacity = positive_int(expert_capacity, "expert_capacity")
        boolean(renormalize_after_drops, "renormalize_after_drops")
        # A tuple of pairs, not a dict: module attributes end up in the (hashed) graph definition.
        self.gating_options = tuple(dict(
            second_expert_threshold=positive_float(second_expert_threshold, "second_expert_threshold"),
            gating_logit_cap=finite_float(gating_logit_cap, "gating_logit_cap", minimum=0.0),
            renormalize_after_drops=renormalize_after_drops,
            mask_dtype=_dtype(mask_dtype, "mask_dtype", allow_bool=True),
        ).items())
        self.fprop_dtype = None if fprop_dtype is None else _dtype(fprop_dtype, "fprop_dtype")
        self.num_experts = num_experts
        self.capacity_factor = float(capacity_factor)
        self.expert_capacity = expert_capacity
        self.router = router
        self.second_expert_policy = second_expert_policy
        self.dispatch = dispatch
        self.group_size = group_size
        self.mesh = mesh
        self.router_weights = _scaled_normal(rngs, (d_model, num_experts), d_model)
        self.expert_wi = _scaled_normal(rngs, (num_experts, d_model, hidden_dim), d_model)
        self.expert_wo = _scaled_normal(rngs, (num_experts, hidden_dim, d_model), hidden_dim)

    def capacity(self, group_size: int) -> int:
        """C for a group of ``group_size`` tokens: ``expert_capacity`` if given, else from
        ``capacity_factor`` (:func:`~carlskit.moe.expert_capacity`, carlskit convention)."""
        if self.expert_capacity is not None:
            return self.expert_capacity
        return expert_capacity(group_size, self.num_experts, self.capacity_factor, experts_per_token(self.router))

    def __call__(
        self, x: jax.Array, *, rng: jax.Array | None = None, paddings: jax.Array | None = None,
        importance: jax.Array | None = None, capacity: int | None = None,
    ) -> tuple[jax.Array, Routing]:
        d_model_expected = self.router_weights.shape[0]
        if getattr(x, "ndim", None) != 3 or x.shape[-1] != d_model_expected:
            raise ValueError(
                f"x must have shape [batch, length, d_model={d_model_expected}], got {getattr(x, 'shape', type(x))}"
            )
        batch, length, d_model = x.shape
        group_size = self.group_size or length
        if (batch * length) % group_size:
            raise ValueError(f"batch * length = {batch * length} must be divisible by group_size={group_size}")
        num_groups = batch * length // group_size
        if self.mesh is not None and num_groups % self.mesh.size:
            raise ValueError(f"number of groups {num_groups} must be divisible by the mesh size {self.mesh.size}")
        for name, value in (("paddings", paddings), ("importance", importance)):
            if value is not None and tuple(getattr(value, "shape", ())) != (batch, length):
                raise ValueError(f"{name} must have shape [batch, length] = {(batch, length)}, "
                                 f"got {getattr(value, 'shape', type(value))}")
        fprop_dtype = self.fprop_dtype or x.dtype
        tokens = split(x.reshape(-1, group_size, d_model), 0, BATCH_AXES, mesh=self.mesh)  # [G, S, M]
        if paddings is not None:
            paddings = split(jnp.asarray(paddings).reshape(-1, group_size), 0, BATCH_AXES, mesh=self.mesh)
        if importance is not None:
            importance = split(jnp.asarray(importance, jnp.float32).reshape(-1, group_size), 0, BATCH_AXES,
                               mesh=self.mesh)
        uniform = None
        if self.router == "top2" and self.second_expert_policy in ("random", "sampling"):
            rng = jax.random.key(0) if rng is None else rng
            shape = tokens.shape[:2] + ((self.num_experts,) if self.second_expert_policy == "sampling" else ())
            uniform = split(jax.random.uniform(rng, shape), 0, BATCH_AXES, mesh=self.mesh)
        # ``capacity`` overrides C for this call: C = S drops nothing (a token's choices are distinct
        # experts), which decoding uses so that a token's output does not depend on its group.
        capacity = self.capacity(group_size) if capacity is None else positive_int(capacity, "capacity")
        weights = (self.router_weights[...], self.expert_wi[...], self.expert_wo[...])
        local = functools.partial(self._local, capacity=capacity, fprop_dtype=fprop_dtype)
        if self.mesh is None or self.mesh.size == 1:
            y, routing = local(tokens, *weights, uniform, paddings, importance, sharded=False)
        else:
            batch_spec, expert_spec = PartitionSpec(BATCH_AXES), PartitionSpec(EXPERT_AXIS)
            optional = lambda value: None if value is None else batch_spec
            routing_spec = Routing(
                batch_spec, batch_spec, PartitionSpec(), PartitionSpec(), group_size,
                dict(self.gating_options)["mask_dtype"]
            )
            y, routing = jax.shard_map(
                functools.partial(local, sharded=True),
                mesh=self.mesh,
                in_specs=(batch_spec, PartitionSpec(), expert_spec, expert_spec, optional(uniform), optional(paddings),
                          optional(importance)),
                out_specs=(batch_spec, routing_spec),
            )(tokens, *weights, uniform, paddings, importance)
        return y.reshape(batch, length, d_model).astype(x.dtype), routing

    def _local(
        self, tokens, router_weights, expert_wi, expert_wo, uniform, paddings, importance, *, capacity: int,
        fprop_dtype, sharded: bool,
    ):
        """Route, dispatch, run the experts and combine, for the groups and experts held locally.

        Sharded (inside ``shard_map``): tokens [G/n, S, M] of this device, expert weights of its
        E/n_expert experts; buffers [E, G/n, C, M] travel by all-to-all over the "expert" axis.
        Experts compute in ``fprop_dtype`` (weights cast on use: float32 masters stay float32).
        """
        logits = jnp.einsum("gsm,me->gse", tokens, router_weights.astype(tokens.dtype))
        options = dict(dict(self.gating_options), paddings=paddings, fprop_dtype=fprop_dtype)
        if importance is not None:  # expert choice has no per-token importance: route() drops it there
            options["importance"] = importance
        if self.router == "top2":
            options.update(second_expert_policy=self.second_expert_policy, second_choice_uniform=uniform)
        routing = route(logits, capacity, router=self.router, **options)
        tokens = tokens.astype(fprop_dtype)
        expert_in = dispatch(routing, tokens, self.dispatch)  # [E, G, C, M]
        if sharded:  # -> [E / n_expert, G * n_expert, C, M]
            expert_in = jax.lax.all_to_all(expert_in, EXPERT_AXIS, 0, 1, tiled=True)
        expert_out = _expert_ffn(expert_in, expert_wi.astype(fprop_dtype), expert_wo.astype(fprop_dtype))
        if sharded:
            expert_out = jax.lax.all_to_all(expert_out, EXPERT_AXIS, 1, 0, tiled=True)
        y = combine(routing, expert_out, self.dispatch)
        if sharded:  # every device holds the same number of groups: global mean = mean of means
            mean = functools.partial(jax.lax.pmean, axis_name=BATCH_AXES)
            routing = dataclasses.replace(
                routing, aux_loss=mean(routing.aux_loss), metrics=jax.tree.map(mean, routing.metrics)
            )
        return y, routing


def _expert_ffn(expert_in: jax.Array, expert_wi: jax.Array, expert_wo: jax.Array) -> jax.Array:
    """Each expert's FFN on its buffer: [E, G, C, M] -> [E, G, C, M].

    Buffers are flattened to [E, G*C, M] first: one canonical batched matmul per layer, whose
    weight gradient XLA's CPU backend computes 2-3x faster than the 4-d einsum's.
    """
    num_experts, groups, capacity, d_model = expert_in.shape
    tokens = expert_in.reshape(num_experts, groups * capacity, d_model)
    hidden = jax.nn.relu(jnp.einsum("etm,emh->eth", tokens, expert_wi))
    return jnp.einsum("eth,ehm->etm", hidden, expert_wo).reshape(num_experts, groups, capacity, d_model)


class CausalSelfAttention(nnx.Module):
    """Multi-head causal self-attention (Vaswani et al. 2017, 3.2; no biases)."""

    def __init__(self, d_model: int, num_heads: int, *, rngs: nnx.Rngs):
        d_model, num_heads = positive_int(d_model, "d_model"), positive_int(num_heads, "num_heads")
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} must be divisible by num_heads={num_heads}")
        head_dim = d_model // num_heads
        self.qkv = _scaled_normal(rngs, (d_model, 3, num_heads, head_dim), d_model)
        self.out = _scaled_normal(rngs, (num_heads, head_dim, d_model), d_model)

    def __call__(self, x: jax.Array) -> jax.Array:
        q, k, v = jnp.unstack(jnp.einsum("blm,mthd->tbhld", x, self.qkv[...].astype(x.dtype)), axis=0)
        scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])
        length = x.shape[1]
        causal = jnp.tril(jnp.ones((length, length), bool))
        # Softmax in float32 whatever the compute dtype (bfloat16 scores lose the small weights).
        weights = jax.nn.softmax(jnp.where(causal, scores.astype(jnp.float32), -1e30), axis=-1).astype(x.dtype)
        return jnp.einsum("bhqk,bhkd,hdm->bqm", weights, v, self.out[...].astype(x.dtype))


class TransformerBlock(nnx.Module):
    """Pre-LayerNorm block: ``x + attn(ln(x))`` then ``x + ffn(ln(x))``; ffn dense or MoE."""

    def __init__(self, d_model: int, num_heads: int, feed_forward: nnx.Module, *, rngs: nnx.Rngs):
        self.attention_norm = nnx.LayerNorm(d_model, rngs=rngs)
        self.attention = CausalSelfAttention(d_model, num_heads, rngs=rngs)
        self.ffn_norm = nnx.LayerNorm(d_model, rngs=rngs)
        self.ffn = feed_forward

    def __call__(
        self, x: jax.Array, *, rng: jax.Array | None = None, paddings: jax.Array | None = None
    ) -> tuple[jax.Array, Routing | None]:
        x = x + self.attention(self.attention_norm(x))
        if isinstance(self.ffn, MoEFeedForward):
            y, routing = self.ffn(self.ffn_norm(x), rng=rng, paddings=paddings)
            return x + y, routing
        return x + self.ffn(self.ffn_norm(x)), None
