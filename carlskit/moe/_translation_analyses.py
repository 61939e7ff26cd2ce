"""GShard's analyses of a trained :class:`~carlskit.moe.TranslationModel` (GShard 5, issue 42):
which experts each language's tokens go to, and how many tokens each MoE layer drops.

Both read the routers' own output (:class:`~carlskit.moe.Routing`): the expert of a token is
:meth:`Routing.top_expert`, the drop fractions are the routers' ``metrics`` (``dropped_first``,
``dropped_second``, ``dropped_tokens``), so the analyses see what training and decoding see.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from carlskit._checks import positive_int
from carlskit.moe._layers import MoEFeedForward
from carlskit.moe._translation import TranslationModel

OVERFLOW_METRICS = ("dropped_first", "dropped_second", "dropped_tokens")


@dataclasses.dataclass(frozen=True)
class ExpertAssignment:
    """Top-1 expert counts per language and encoder MoE layer.

    Attributes:
      tags: the model's language tags (rows).
      layers: the encoder MoE layers' names (``"encoder 1"``: block 1 of the encoder).
      counts: int64 [layers, tags, experts]: text tokens of each tag's sources whose top-1 expert
        (:meth:`~carlskit.moe.Routing.top_expert`) is each expert.
    """

    tags: tuple[str, ...]
    layers: tuple[str, ...]
    counts: np.ndarray

    @property
    def tokens(self) -> np.ndarray:
        """int64 [layers, tags]: text tokens counted per tag (the same in every layer)."""
        return self.counts.sum(axis=-1)

    @property
    def fractions(self) -> np.ndarray:
        """float64 [layers, tags, experts]: ``counts / tokens``, each row summing to 1 (0 for a tag
        with no tokens): the language x expert heatmap of GShard's analysis."""
        tokens = self.tokens[..., None]
        return np.divide(self.counts, tokens, out=np.zeros(self.counts.shape), where=tokens > 0)


def _moe_layer_names(model: TranslationModel, stacks: tuple[str, ...]) -> tuple[str, ...]:
    names = tuple(f"{stack} {i}" for stack in stacks for i, block in enumerate(getattr(model, stack))
                  if isinstance(block.ffn, MoEFeedForward))
    if not names:
        raise ValueError("model has no MoE layer (num_experts=0 builds the dense model): nothing is routed")
    return names


def _source_rows(model: TranslationModel, source: Any) -> np.ndarray:
    source = np.asarray(source)
    if source.ndim != 2 or source.shape[1] != model.max_source_length or not np.issubdtype(source.dtype, np.integer):
        raise ValueError(f"source must be int [rows, max_source_length={model.max_source_length}] (from "
                         f"encode_sources), got {source.dtype} {source.shape}")
    tags = source[:, 0] - model.first_tag if len(source) else source[:, 0]
    if len(source) and (tags.min() < 0 or tags.max() >= len(model.tags)):
        raise ValueError("source rows must start with a language tag id (rows from encode_sources)")
    return source.astype(np.int32)


@functools.partial(jax.jit, static_argnums=(0,))
def _assignment_counts(graphdef: nnx.GraphDef, state: nnx.State, source: jax.Array) -> jax.Array:
    model = nnx.merge(graphdef, state)
    # C = S drops nothing: every token's top-1 expert is its first choice (as at decoding).
    _, _, routings = model.encode(source, capacity=source.shape[1])
    text = (source != model.pad_id) & (jnp.arange(source.shape[1]) > 0)  # the tag itself is not counted
    tag = source[:, 0] - model.first_tag
    counts = []
    for routing in routings:  # one group per source row (group_size = length)
        expert = routing.top_expert().reshape(source.shape)
        per_row = jnp.sum(jax.nn.one_hot(expert, routing.num_experts, dtype=jnp.int32) * text[..., None], axis=1)
        counts.append(jax.ops.segment_sum(per_row, tag, num_segments=len(model.tags)))
    return jnp.stack(counts)


def expert_assignment(model: TranslationModel, source: Any, *, batch_size: int = 256) -> ExpertAssignment:
    """Which experts each language's tokens go to (GShard 5's language x expert heatmap).

    ``source``: int rows [N, max_source_length] from :meth:`TranslationModel.encode_sources`; each
    row's language is its tag (the first token). Every encoder MoE layer routes the rows with
    C = S (nothing dropped, as at decoding), and each text token (not the tag, not padding) counts
    once for its top-1 expert, the expert of largest combine weight. Rows run in batches of
    ``batch_size`` (the last padded with empty rows, which count nothing).

    Returns an :class:`ExpertAssignment` (``counts``, ``fractions`` [layers, tags, experts]).
    """
    if not isinstance(model, TranslationModel):
        raise TypeError(f"model must be a TranslationModel, got {type(model).__name__}")
    batch_size = positive_int(batch_size, "batch_size")
    layers = _moe_layer_names(model, ("encoder",))
    source = _source_rows(model, source)
    num_experts = model.num_experts
    counts = np.zeros((len(layers), len(model.tags), num_experts), np.int64)
    graphdef, state = nnx.split(model)
    for start in range(0, len(source), batch_size):
        rows = source[start : start + batch_size]
        padded = np.full((batch_size, rows.shape[1]), model.pad_id, np.int32)
        padded[:, 0] = model.first_tag
        padded[: len(rows)] = rows
        counts += np.asarray(jax.device_get(_assignment_counts(graphdef, state, jax.device_put(padded))), np.int64)
    return ExpertAssignment(tuple(model.tags), layers, counts)


@functools.partial(jax.jit, static_argnums=(0,))
def _overflow_metrics(graphdef: nnx.GraphDef, state: nnx.State, source: jax.Array, target: jax.Array,
                      rng: jax.Array | None) -> list[dict]:
    _, routings = nnx.merge(graphdef, state).teacher_forced(source, target, rng=rng)
    return [{name: routing.metrics[name] for name in OVERFLOW_METRICS} for routing in routings]


def capacity_overflow(model: TranslationModel, source: Any, target: Any, *,
                      rng: jax.Array | None = None) -> list[dict[str, Any]]:
    """Tokens over capacity in every MoE layer for one batch, as training routes it (GShard 2.2).

    ``source`` / ``target``: int rows from :meth:`TranslationModel.encode_sources` /
    :meth:`~TranslationModel.encode_targets`, run with teacher forcing at the training capacity
    (``capacity_factor``); ``rng`` as in training (dropout and the routers' random numbers; None:
    no dropout). Returns one row per MoE layer, encoder's then decoder's: ``layer``
    (``"decoder 1"``), ``capacity`` (C), and the router's own fractions of the layer's real tokens:
    ``dropped_first`` (first choice over capacity), ``dropped_second`` (second choice attempted
    and over capacity), ``dropped_tokens`` (dispatched nowhere: the layer passes them on unchanged).
    """
    if not isinstance(model, TranslationModel):
        raise TypeError(f"model must be a TranslationModel, got {type(model).__name__}")
    layers = _moe_layer_names(model, ("encoder", "decoder"))
    source = _source_rows(model, source)
    target = np.asarray(target)
    if target.ndim != 2 or target.shape != (len(source), model.max_target_length) or \
            not np.issubdtype(target.dtype, np.integer):
        raise ValueError(f"target must be int [rows={len(source)}, max_target_length={model.max_target_length}], "
                         f"got {target.dtype} {target.shape}")
    graphdef, state = nnx.split(model)
    metrics = jax.device_get(_overflow_metrics(graphdef, state, jax.device_put(source),
                                               jax.device_put(target.astype(np.int32)), rng))
    capacities = [block.ffn.capacity(length)
                  for stack, length in ((model.encoder, model.max_source_length),
                                        (model.decoder, model.max_target_length))
                  for block in stack if isinstance(block.ffn, MoEFeedForward)]
    return [{"layer": name, "capacity": int(capacity), **{key: float(value) for key, value in row.items()}}
            for name, capacity, row in zip(layers, capacities, metrics)]
