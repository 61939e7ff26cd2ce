"""GShard's own model: a multilingual encoder-decoder MoE Transformer that translates (GShard 2.1, 5).

``TranslationModel`` has an encoder and a decoder stack whose every other feed-forward layer is a
top-2 :class:`~carlskit.moe.MoEFeedForward` (same gating, sharding annotations and expert-parallel
all-to-all as :class:`~carlskit.moe.MoEModel`), cross-attention from decoder to encoder, one
embedding shared by source, target and output (tied), a language tag as the first source token,
dropout, and Adafactor (``optax.adafactor``: factored second moments, no first moment, as GShard)
with Adam as an option.

Text is token ids from a tokenizer (:class:`carlskit.data.Tokenizer`): UTF-8 bytes by default
(:class:`carlskit.data.ByteTokenizer`, ids 0-255, then :data:`PAD`, :data:`BOS`, :data:`EOS`), or a
shared subword vocabulary (:func:`carlskit.data.load_vocabulary`: sentencepiece, GShard's and M4's
choice, about 4x fewer tokens per sentence than bytes). A tokenizer of ``n`` text ids puts padding,
begin and end at ``n``, ``n + 1``, ``n + 2`` (``pad_id``, ``bos_id``, ``eos_id``), then one id per tag.
Tag ``"fr"`` means "this source is French, translate into English"; ``"2fr"`` means "translate
this English source into French" (M4's ``<2xx>`` convention).

Decoding (:meth:`TranslationModel.translate`): greedy or beam search, jitted (``lax.while_loop``),
batched, with a key-value cache (self-attention keys and values appended per step, cross-attention
keys and values computed once) or without (the whole prefix re-run each step, the reference the
cache is tested against). Beam search ranks hypotheses by log-probability / lp(length),
lp(n) = ((5 + n) / 6) ** alpha (GNMT, Wu et al. 2016, eq. 14). At decoding every MoE layer runs with
capacity C = S, so no token is dropped and a token's output does not depend on the other tokens of
its group: cached and uncached decoding then compute the same function.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import math
import os
import pathlib
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from carlskit._checks import choice, finite_float, integer, positive_float, positive_int
from carlskit._checks import path as check_path
from carlskit._errors import CorruptFileError
from carlskit._history import History
from carlskit._serialization import (
    arrays_to_npz_bytes,
    atomic_write,
    check_seal,
    dumps_checked_json,
    filesystem,
    flatten_pytree,
    loads_checked_json,
    npz_bytes_to_arrays,
    seal_zip,
    unflatten_into,
)
from carlskit._transfers import steady_state
from carlskit.moe._layers import BATCH_AXES, MoEFeedForward, _scaled_normal
from carlskit.moe._model import _checked_mesh, _moe_options, feed_forward_for_layer, place_parameters, step_routing_keys
from carlskit.moe._sharding import split

if TYPE_CHECKING:
    from carlskit.data import Tokenizer

PAD, BOS, EOS = 256, 257, 258  # the byte tokenizer's (the default) padding, begin and end ids
FIRST_TAG = 259
OPTIMIZERS = ("adafactor", "adam")
MODEL_FORMAT = "carlskit.translation-model/1"
PRETRAINED_FILE = "pretrained_translation.npz"  # in carlskit/moe/, shipped as package data
DESCRIPTION_ENTRY = "description"  # the checked JSON document, as uint8
TOKENIZER_ENTRY = "tokenizer"  # the sentencepiece model's bytes, as uint8


def length_penalty(length: jax.Array, alpha: float) -> jax.Array:
    """GNMT's length normalisation ``((5 + length) / 6) ** alpha`` (Wu et al. 2016, eq. 14)."""
    return ((5.0 + length.astype(jnp.float32)) / 6.0) ** alpha


def _dropout(x: jax.Array, rate: float, rng: jax.Array | None) -> jax.Array:
    if rng is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)


def _fold(rng: jax.Array | None, *data: int) -> jax.Array | None:
    for value in data:
        rng = None if rng is None else jax.random.fold_in(rng, value)
    return rng


class Attention(nnx.Module):
    """Multi-head attention of queries ``x`` on keys / values from a context (self or cross), with a
    boolean mask (True = may attend); keys and values are projected apart so a decoder can cache them."""

    def __init__(self, d_model: int, num_heads: int, *, rngs: nnx.Rngs):
        head_dim = d_model // num_heads
        self.query = _scaled_normal(rngs, (d_model, num_heads, head_dim), d_model)
        self.key_value = _scaled_normal(rngs, (d_model, 2, num_heads, head_dim), d_model)
        self.out = _scaled_normal(rngs, (num_heads, head_dim, d_model), d_model)

    def keys_values(self, context: jax.Array) -> tuple[jax.Array, jax.Array]:
        """[B, K, M] -> keys, values [B, H, K, D]."""
        keys, values = jnp.unstack(jnp.einsum("bkm,mthd->tbhkd", context, self.key_value[...]), axis=0)
        return keys, values

    def __call__(self, x: jax.Array, keys: jax.Array, values: jax.Array, mask: jax.Array) -> jax.Array:
        query = jnp.einsum("bqm,mhd->bhqd", x, self.query[...])
        scores = jnp.einsum("bhqd,bhkd->bhqk", query, keys) / math.sqrt(query.shape[-1])
        weights = jax.nn.softmax(jnp.where(mask, scores, -1e30), axis=-1)
        return jnp.einsum("bhqk,bhkd,hdm->bqm", weights, values, self.out[...])


def _feed_forward(ffn: nnx.Module, x: jax.Array, rng, paddings, capacity) -> tuple[jax.Array, Any]:
    if isinstance(ffn, MoEFeedForward):
        return ffn(x, rng=rng, paddings=paddings, capacity=capacity)
    return ffn(x), None


class EncoderBlock(nnx.Module):
    """Pre-LayerNorm: ``x + attn(ln(x))`` (bidirectional, source padding masked), ``x + ffn(ln(x))``."""

    def __init__(self, d_model: int, num_heads: int, feed_forward: nnx.Module, *, rngs: nnx.Rngs):
        self.attention_norm = nnx.LayerNorm(d_model, rngs=rngs)
        self.attention = Attention(d_model, num_heads, rngs=rngs)
        self.ffn_norm = nnx.LayerNorm(d_model, rngs=rngs)
        self.ffn = feed_forward


class DecoderBlock(nnx.Module):
    """Pre-LayerNorm: causal self-attention, cross-attention to the encoder output, FFN."""

    def __init__(self, d_model: int, num_heads: int, feed_forward: nnx.Module, *, rngs: nnx.Rngs):
        self.attention_norm = nnx.LayerNorm(d_model, rngs=rngs)
        self.attention = Attention(d_model, num_heads, rngs=rngs)
        self.cross_norm = nnx.LayerNorm(d_model, rngs=rngs)
        self.cross_attention = Attention(d_model, num_heads, rngs=rngs)
        self.ffn_norm = nnx.LayerNorm(d_model, rngs=rngs)
        self.ffn = feed_forward


class TranslationModel(nnx.Module):
    """Multilingual encoder-decoder MoE Transformer (GShard's M4 model, small) over UTF-8 bytes or
    a shared subword vocabulary.

    Args:
      tags: the language tags the model knows (``"fr"``: French into English, ``"2fr"``: English
        into French); each gets a token id.
      num_layers: layers of each stack (encoder and decoder); odd layers (or the only one) are MoE.
      d_model, num_heads, ffn_dim: widths (``ffn_dim`` defaults to 4 * d_model).
      num_experts: experts per MoE layer; 0 builds the dense model of equal per-token FLOPs (its MoE
        slots are dense FFNs of width 2 * ffn_dim for top-2).
      max_source_length, max_target_length: token lengths (source with its tag; target with EOS).
      dropout_rate: dropout on embeddings and every residual branch while training.
      capacity_factor, second_expert_policy, router, dispatch, aux_loss_weight: as
        :class:`~carlskit.moe.MoEModel` (policy "all" by default: every token goes to both its
        experts as capacity allows, the dense model's per-token FLOPs).
      mesh: a ``Mesh`` with axes "data" and "expert": expert weights split over "expert", batches
        over all devices, the dispatch an all-to-all (training and :meth:`loss`).
      seed: parameter seed (the same parameters with or without a mesh).
      tokenizer: text to ids and back (:class:`carlskit.data.Tokenizer`); default UTF-8 bytes
        (:class:`carlskit.data.ByteTokenizer`); :func:`carlskit.data.load_vocabulary` gives the
        shipped shared sentencepiece vocabulary. Lengths are in its tokens.

    ``loss = cross-entropy over real target tokens + aux_loss_weight * mean aux loss``.

    ``config`` holds the constructor arguments (pairs, without mesh and seed) that :meth:`save`
    writes with the parameters; :meth:`load` and :meth:`pretrained` read such a file back.
    """

    def __init__(
        self,
        tags: Sequence[str],
        num_layers: int = 2,
        d_model: int = 64,
        num_heads: int = 4,
        num_experts: int = 0,
        *,
        ffn_dim: int | None = None,
        max_source_length: int = 64,
        max_target_length: int = 64,
        dropout_rate: float = 0.1,
        capacity_factor: float = 2.0,
        aux_loss_weight: float = 1e-2,
        second_expert_policy: str = "all",
        router: str = "top2",
        dispatch: str = "scatter",
        mesh: Mesh | None = None,
        seed: int = 0,
        tokenizer: Tokenizer | None = None,
    ):
        from carlskit.data import ByteTokenizer, Tokenizer

        tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
        if not isinstance(tokenizer, Tokenizer) or not isinstance(tokenizer.vocab_size, int) \
                or tokenizer.vocab_size < 1:
            raise TypeError(f"tokenizer must be a carlskit.data.Tokenizer (vocab_size, encode, decode), "
                            f"got {type(tokenizer).__name__}")
        if isinstance(tags, str) or not all(isinstance(t, str) and t for t in tags) or not len(tags):
            raise TypeError(f"tags must be a non-empty sequence of non-empty str, got {tags!r}")
        if len(set(tags)) != len(tags):
            raise ValueError(f"tags must be distinct, got {list(tags)}")
        for name, value in (("num_layers", num_layers), ("d_model", d_model), ("num_heads", num_heads),
                            ("max_source_length", max_source_length), ("max_target_length", max_target_length)):
            positive_int(value, name)
        integer(num_experts, "num_experts", minimum=0)
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} must be divisible by num_heads={num_heads}")
        finite_float(dropout_rate, "dropout_rate", minimum=0.0)
        if dropout_rate >= 1.0:
            raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")
        moe_options = _moe_options(
            router=router, capacity_factor=capacity_factor, second_expert_policy=second_expert_policy,
            dispatch=dispatch, group_size=None, aux_loss_weight=aux_loss_weight, z_loss_weight=0.0,
            second_expert_threshold=0.5, gating_logit_cap=0.0, renormalize_after_drops=False, expert_capacity=None,
        )
        ffn_dim = 4 * d_model if ffn_dim is None else positive_int(ffn_dim, "ffn_dim")
        self.tags = tuple(tags)
        self.tokenizer = tokenizer  # static (hashable by content): decoding's jit sees it in the graph
        self.pad_id, self.bos_id, self.eos_id = tokenizer.vocab_size, tokenizer.vocab_size + 1, tokenizer.vocab_size + 2
        self.first_tag = tokenizer.vocab_size + 3
        self.vocab_size = self.first_tag + len(self.tags)
        self.num_experts = int(num_experts)
        self.max_source_length = int(max_source_length)
        self.max_target_length = int(max_target_length)
        self.dropout_rate = float(dropout_rate)
        self.aux_loss_weight = float(aux_loss_weight)
        # What save() writes and load() rebuilds from (a tuple of pairs: module attributes are part
        # of the hashed graph definition).
        self.config = tuple(dict(
            tags=self.tags, num_layers=int(num_layers), d_model=int(d_model), num_heads=int(num_heads),
            num_experts=self.num_experts, ffn_dim=int(ffn_dim), max_source_length=self.max_source_length,
            max_target_length=self.max_target_length, dropout_rate=self.dropout_rate,
            capacity_factor=float(capacity_factor), aux_loss_weight=self.aux_loss_weight,
            second_expert_policy=second_expert_policy, router=router, dispatch=dispatch,
        ).items())
        self.info_json = "{}"  # a str, hashable as the graph definition needs: see ``info``
        self.mesh = None if mesh is None else _checked_mesh(mesh)
        rngs = nnx.Rngs(params=seed)
        self.embedding = _scaled_normal(rngs, (self.vocab_size, d_model), d_model)  # shared and tied
        self.source_positions = _scaled_normal(rngs, (max_source_length, d_model), 2500.0)  # std 0.02
        self.target_positions = _scaled_normal(rngs, (max_target_length, d_model), 2500.0)

        def ffn(layer: int) -> nnx.Module:
            return feed_forward_for_layer(layer, num_layers, d_model, ffn_dim, self.num_experts, moe_options,
                                          self.mesh, rngs)

        self.encoder = nnx.List([EncoderBlock(d_model, num_heads, ffn(i), rngs=rngs) for i in range(num_layers)])
        self.encoder_norm = nnx.LayerNorm(d_model, rngs=rngs)
        self.decoder = nnx.List([DecoderBlock(d_model, num_heads, ffn(i), rngs=rngs) for i in range(num_layers)])
        self.decoder_norm = nnx.LayerNorm(d_model, rngs=rngs)
        if self.mesh is not None:
            place_parameters(self, self.mesh)

    # ----------------------------------------------------------------------------- text <-> ids
    def tag_id(self, tag: str) -> int:
        if tag not in self.tags:
            raise ValueError(f"lang must be one of the model's tags {list(self.tags)[:12]}..., got {tag!r}")
        return self.first_tag + self.tags.index(tag)

    def encode_sources(self, texts: Sequence[str], tags: Sequence[str] | str) -> np.ndarray:
        """int32 [N, max_source_length]: each text's tag id, then its tokens (cut to fit), padding."""
        texts = _texts(texts, "texts")
        tags = [tags] * len(texts) if isinstance(tags, str) else list(tags)
        if len(tags) != len(texts):
            raise ValueError(f"lang must be one tag or one per text ({len(texts)}), got {len(tags)}")
        rows = np.full((len(texts), self.max_source_length), self.pad_id, np.int32)
        for i, (ids, tag) in enumerate(zip(self.tokenizer.encode(texts), tags)):
            data = list(ids)[: self.max_source_length - 1]
            rows[i, 0] = self.tag_id(tag)
            rows[i, 1 : 1 + len(data)] = data
        return rows

    def encode_targets(self, texts: Sequence[str]) -> np.ndarray:
        """int32 [N, max_target_length]: tokens, end (when it fits), padding."""
        texts = _texts(texts, "texts")
        rows = np.full((len(texts), self.max_target_length), self.pad_id, np.int32)
        for i, ids in enumerate(self.tokenizer.encode(texts)):
            data = (list(ids) + [self.eos_id])[: self.max_target_length]
            rows[i, : len(data)] = data
        return rows

    def decode_ids(self, ids: np.ndarray) -> list[str]:
        """Token rows to text: tokens up to the first end or padding id, decoded by the tokenizer
        (bytes: a cut multi-byte character dropped)."""
        rows = []
        for row in np.asarray(ids):
            stop = np.flatnonzero(row >= self.pad_id)
            rows.append((row[: stop[0]] if len(stop) else row).tolist())
        return self.tokenizer.decode(rows)

    def fits(self, source: str, target: str) -> bool:
        """Whether a pair fits the model's lengths whole (tag + source, target + end), in tokens."""
        source_ids, target_ids = self.tokenizer.encode([source, target])
        return len(source_ids) + 1 <= self.max_source_length and len(target_ids) + 1 <= self.max_target_length

    # ----------------------------------------------------------------------------- forward
    def _embed(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        embedding = self.embedding[...]
        return jnp.take(embedding, tokens, axis=0) * math.sqrt(embedding.shape[1]) + positions

    def encode(self, source: jax.Array, *, rng: jax.Array | None = None, capacity: int | None = None):
        """Encoder output [B, Ls, M], the source mask [B, Ls] (True = real token) and the routings."""
        paddings = (source == self.pad_id).astype(jnp.int32)
        x = split(self._embed(source, self.source_positions[...][: source.shape[1]]), 0, BATCH_AXES, mesh=self.mesh)
        x = _dropout(x, self.dropout_rate, _fold(rng, 0))
        mask = (source != self.pad_id)[:, None, None, :]
        routings = []
        for i, block in enumerate(self.encoder):
            h = block.attention_norm(x)
            x = x + _dropout(block.attention(h, *block.attention.keys_values(h), mask), self.dropout_rate,
                             _fold(rng, 1, i))
            y, routing = _feed_forward(block.ffn, block.ffn_norm(x), _fold(rng, 2, i), paddings, capacity)
            x = x + _dropout(y, self.dropout_rate, _fold(rng, 3, i))
            routings += [routing] if routing is not None else []
        return self.encoder_norm(x), source != self.pad_id, routings

    def decode(self, target_in: jax.Array, encoded: jax.Array, source_mask: jax.Array, *,
               rng: jax.Array | None = None, capacity: int | None = None):
        """Logits [B, Lt, vocab] (float32) for decoder inputs [B, Lt] (BOS, then the target shifted)."""
        length = target_in.shape[1]
        paddings = (target_in == self.pad_id).astype(jnp.int32)
        x = split(self._embed(target_in, self.target_positions[...][:length]), 0, BATCH_AXES, mesh=self.mesh)
        x = _dropout(x, self.dropout_rate, _fold(rng, 10))
        causal = jnp.tril(jnp.ones((length, length), bool))[None, None]
        cross = source_mask[:, None, None, :]
        routings = []
        for i, block in enumerate(self.decoder):
            h = block.attention_norm(x)
            x = x + _dropout(block.attention(h, *block.attention.keys_values(h), causal), self.dropout_rate,
                             _fold(rng, 11, i))
            h = block.cross_norm(x)
            x = x + _dropout(block.cross_attention(h, *block.cross_attention.keys_values(encoded), cross),
                             self.dropout_rate, _fold(rng, 12, i))
            y, routing = _feed_forward(block.ffn, block.ffn_norm(x), _fold(rng, 13, i), paddings, capacity)
            x = x + _dropout(y, self.dropout_rate, _fold(rng, 14, i))
            routings += [routing] if routing is not None else []
        logits = (self.decoder_norm(x) @ self.embedding[...].T).astype(jnp.float32)
        return split(logits, 0, BATCH_AXES, mesh=self.mesh), routings

    def teacher_forced(self, source: jax.Array, target: jax.Array, *, rng: jax.Array | None = None,
                       capacity: int | None = None) -> tuple[jax.Array, list]:
        """Logits [B, Lt, vocab] for target [B, Lt] given source [B, Ls] (decoder inputs: BOS, then
        the target shifted), and the routings of every MoE layer, encoder's then decoder's, in
        layer order (``capacity`` overrides every MoE layer's C, as :meth:`encode`)."""
        target_in = jnp.concatenate([jnp.full((target.shape[0], 1), self.bos_id, target.dtype), target[:, :-1]],
                                    axis=1)
        encoded, source_mask, routings = self.encode(source, rng=_fold(rng, 100), capacity=capacity)
        logits, decoder_routings = self.decode(target_in, encoded, source_mask, rng=_fold(rng, 200),
                                               capacity=capacity)
        return logits, routings + decoder_routings

    def loss_and_metrics(self, source: jax.Array, target: jax.Array, *, rng: jax.Array | None = None):
        """Loss and metrics (cross_entropy per real target token, aux_loss, dropped_tokens,
        target_tokens) for source [B, Ls] and target [B, Lt] ids (teacher forcing; ``rng`` turns on
        dropout and draws the routing's random numbers)."""
        logits, routings = self.teacher_forced(source, target, rng=rng)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, target)
        real = (target != self.pad_id).astype(jnp.float32)
        target_tokens = jnp.sum(real)
        cross_entropy = jnp.sum(losses * real) / jnp.maximum(target_tokens, 1.0)
        metrics = {"cross_entropy": cross_entropy, "target_tokens": target_tokens}
        loss = cross_entropy
        if routings:
            aux = jnp.mean(jnp.stack([r.aux_loss for r in routings]))
            loss = loss + self.aux_loss_weight * aux
            metrics["aux_loss"] = aux
            metrics["dropped_tokens"] = jnp.mean(jnp.stack([r.metrics["dropped_tokens"] for r in routings]))
        metrics["loss"] = loss
        return loss, metrics

    def loss(self, source: jax.Array, target: jax.Array, *, rng: jax.Array | None = None) -> jax.Array:
        return self.loss_and_metrics(source, target, rng=rng)[0]

    def shard_batch(self, rows: np.ndarray) -> jax.Array:
        """int32 rows on the device(s): split over all devices of the mesh (if any)."""
        rows = np.asarray(rows, np.int32)
        if self.mesh is not None and rows.shape[0] % self.mesh.size:
            raise ValueError(f"batch {rows.shape[0]} must be divisible by the mesh size {self.mesh.size}")
        # one explicit transfer, straight to the devices (jnp.asarray would be an implicit one)
        return jax.device_put(rows, None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec(BATCH_AXES)))

    # ----------------------------------------------------------------------------- training
    def fit(
        self,
        source: np.ndarray,
        target: np.ndarray,
        *,
        steps: int,
        batch_size: int = 64,
        optimizer: str | optax.GradientTransformation = "adafactor",
        learning_rate: float | None = None,
        seed: int = 0,
        callback: Callable[[int, dict], None] | None = None,
    ) -> History:
        """Train on rows ``source`` [N, Ls] / ``target`` [N, Lt] (from :meth:`encode_sources` /
        :meth:`encode_targets`), random batches of ``batch_size``; parameters updated in place.

        ``optimizer``: ``"adafactor"`` (``optax.adafactor``, factored second moments, no momentum,
        updates scaled by the parameters' RMS; default learning rate 1e-2), ``"adam"`` (default 1e-3)
        or any optax transformation. Returns the history (:class:`carlskit.History`): one record per
        step with ``step`` (1 for the first), ``loss``, ``cross_entropy``, ``aux_loss``, ``seconds``
        (wall time since the start); ``callback(step, record)`` per step (``step`` from 0). The loop
        is a :class:`carlskit.training.Trainer`'s without its finiteness check, as ``MoEModel.fit``.
        """
        from carlskit.training import Trainer  # training imports the bank and Dask: only when fitting

        source, target = np.asarray(source), np.asarray(target)
        if source.ndim != 2 or source.shape[1] != self.max_source_length or not np.issubdtype(source.dtype,
                                                                                               np.integer):
            raise ValueError(f"source must be int [rows, max_source_length={self.max_source_length}], "
                             f"got {source.dtype} {source.shape}")
        if target.ndim != 2 or target.shape != (len(source), self.max_target_length):
            raise ValueError(f"target must be int [rows={len(source)}, max_target_length={self.max_target_length}], "
                             f"got {target.dtype} {target.shape}")
        for name, rows in (("source", source), ("target", target)):
            if rows.size and (rows.min() < 0 or rows.max() >= self.vocab_size):
                raise ValueError(f"{name} holds ids outside [0, vocab_size={self.vocab_size})")
        steps = integer(steps, "steps", minimum=0)
        batch_size = positive_int(batch_size, "batch_size")
        if len(source) < batch_size:
            raise ValueError(f"source must hold at least batch_size={batch_size} rows, got {len(source)}")
        tx = _optimizer(optimizer, learning_rate)
        if callback is not None and not callable(callback):
            raise TypeError(f"callback must be callable as callback(step, record), got {type(callback).__name__}")
        if not steps:
            return History()
        rows = np.random.default_rng(seed).integers(0, len(source), (steps, batch_size))  # as drawn step by step
        key_at = step_routing_keys(seed, self.mesh)

        def batch_at(step: int) -> dict:
            return {"source": self.shard_batch(source[rows[step]]), "target": self.shard_batch(target[rows[step]]),
                    "rng": key_at(step)}

        started = time.perf_counter()

        def on_record(record: dict) -> None:
            record["seconds"] = time.perf_counter() - started
            if callback is not None:
                callback(record["step"] - 1, record)

        trainer = Trainer(self, tx, _pairs_loss, check_finite=False)
        return trainer.fit(batch_at, steps, progress=False, live=False, callback=on_record)

    # ----------------------------------------------------------------------------- persistence
    @property
    def info(self) -> dict:
        """What :meth:`save` stored with the model (how it was trained, its scores); ``{}`` for a
        model built here."""
        return json.loads(self.info_json)

    def save(self, path: str | os.PathLike, *, info: dict | None = None) -> pathlib.Path:
        """Write the model to one sealed ``.npz``, atomically; returns the file written.

        The file (``path``, ``.npz`` appended unless it ends so) holds every parameter by its key
        path, the sentencepiece model's bytes when the tokenizer is one, and a checksummed JSON
        description: the constructor arguments, the tokenizer, and ``info`` (plain JSON: how it was
        trained, its scores). No pickle; the zip is sealed with the SHA-256 of every byte
        (``carlskit._serialization.seal_zip``), so :meth:`load` refuses any damage.
        """
        from carlskit.data import ByteTokenizer, SentencePieceTokenizer

        target = pathlib.Path(os.fspath(check_path(path, "path")))
        target = target if target.name.endswith(".npz") else target.with_name(target.name + ".npz")
        arrays, _ = flatten_pytree(nnx.state(self, nnx.Param))
        arrays = {f"param:{name}": value for name, value in arrays.items()}
        # exact types: a subclass may encode differently, and load() would rebuild the base class
        if type(self.tokenizer) is SentencePieceTokenizer:
            tokenizer = {"kind": "sentencepiece", "sha256": self.tokenizer.sha256, "training": self.tokenizer.training}
            arrays[TOKENIZER_ENTRY] = np.frombuffer(self.tokenizer.model, np.uint8)
        elif type(self.tokenizer) is ByteTokenizer:
            tokenizer = {"kind": "bytes"}
        else:
            raise TypeError(f"save needs a ByteTokenizer or a SentencePieceTokenizer, the model holds "
                            f"{type(self.tokenizer).__name__}")
        document = {"format": MODEL_FORMAT, "config": {k: list(v) if isinstance(v, tuple) else v
                                                      for k, v in self.config},
                    "tokenizer": tokenizer, "info": {} if info is None else info}
        try:
            description = dumps_checked_json(document)
        except (TypeError, ValueError) as error:
            raise ValueError(f"info must be plain, finite JSON: {error}") from error
        arrays[DESCRIPTION_ENTRY] = np.frombuffer(description, np.uint8)
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(*filesystem(os.fspath(target)), seal_zip(arrays_to_npz_bytes(arrays)))
        return target

    @classmethod
    def load(cls, path: str | os.PathLike) -> TranslationModel:
        """The model :meth:`save` wrote to ``path`` (its ``info`` in ``model.info``).

        Raises ``FileNotFoundError`` naming the file when it is absent and
        :class:`carlskit.CorruptFileError` (a ``ValueError``) naming it for any damage: a broken seal,
        an unreadable archive or description, parameters that do not fit the described model.
        """
        from carlskit.data import ByteTokenizer, SentencePieceTokenizer

        file = pathlib.Path(os.fspath(check_path(path, "path")))
        if not file.is_file():
            raise FileNotFoundError(f"{file}: no translation model file there")
        data = file.read_bytes()
        check_seal(data, file)
        arrays = npz_bytes_to_arrays(data, file)
        if DESCRIPTION_ENTRY not in arrays:
            raise CorruptFileError(file, "no description entry: not a carlskit translation model file")
        document = loads_checked_json(arrays.pop(DESCRIPTION_ENTRY).tobytes(), file)
        if not isinstance(document, dict) or document.get("format") != MODEL_FORMAT:
            raise CorruptFileError(file, f"not a carlskit translation model file ({MODEL_FORMAT})")
        try:
            kind = document["tokenizer"]["kind"]
            if kind == "sentencepiece":
                tokenizer = SentencePieceTokenizer(arrays.pop(TOKENIZER_ENTRY).tobytes(),
                                                   training=document["tokenizer"]["training"])
                if tokenizer.sha256 != document["tokenizer"]["sha256"]:
                    raise ValueError("the sentencepiece model does not match its SHA-256")
            elif kind == "bytes":
                tokenizer = ByteTokenizer()
            else:
                raise ValueError(f"unknown tokenizer kind {kind!r}")
            model = cls(**document["config"], tokenizer=tokenizer)
            params = {name[len("param:"):]: value for name, value in arrays.items() if name.startswith("param:")}
            if len(params) != len(arrays):
                raise ValueError(f"unexpected entries {sorted(set(arrays) - {f'param:{n}' for n in params})[:5]}")
            nnx.update(model, unflatten_into(nnx.state(model, nnx.Param), params, {}))
        except (KeyError, TypeError, ValueError, RuntimeError) as error:
            raise CorruptFileError(file, f"does not describe a translation model that fits its parameters "
                                         f"({type(error).__name__}: {error})") from error
        if not isinstance(document.get("info"), dict):
            raise CorruptFileError(file, "its 'info' is not a JSON object")
        model.info_json = json.dumps(document["info"], sort_keys=True)
        return model

    @classmethod
    def pretrained(cls, path: str | os.PathLike | None = None) -> TranslationModel:
        """The translation model that ships with carlskit (``carlskit/moe/pretrained_translation.npz``), or
        the model file at ``path``: :meth:`load`, with an error naming the shipped file when it is
        absent (``FileNotFoundError``) or damaged (:class:`carlskit.CorruptFileError`).
        """
        if path is not None:
            return cls.load(path)
        resource = importlib.resources.files("carlskit.moe") / PRETRAINED_FILE
        with importlib.resources.as_file(resource) as file:
            if not pathlib.Path(file).is_file():
                raise FileNotFoundError(f"{file}: the pretrained translation model is not in this installation "
                                        f"(issue 42's training campaign writes it with TranslationModel.save)")
            return cls.load(file)

    # ----------------------------------------------------------------------------- decoding
    def translate(self, texts: Sequence[str], lang: str | Sequence[str], *, beam_size: int = 1,
                  alpha: float = 0.6, cached: bool = True, batch_size: int = 64) -> list[str]:
        """Translate ``texts`` (tag ``lang``: one for all, or one per text) by greedy search
        (``beam_size=1``) or beam search with length normalisation ``alpha``; batched by
        ``batch_size`` rows (the last batch padded, so one compilation serves all)."""
        source = self.encode_sources(texts, lang)
        return self.decode_ids(self.generate(source, beam_size=beam_size, alpha=alpha, cached=cached,
                                             batch_size=batch_size))

    def generate(self, source: np.ndarray, *, beam_size: int = 1, alpha: float = 0.6, cached: bool = True,
                 batch_size: int = 64) -> np.ndarray:
        """Output ids [N, max_target_length] (EOS then PAD after a finished text) for source rows."""
        beam_size = positive_int(beam_size, "beam_size")
        batch_size = positive_int(batch_size, "batch_size")
        finite_float(alpha, "alpha", minimum=0.0)
        if not isinstance(cached, bool):
            raise TypeError(f"cached must be a bool, got {cached!r}")
        source = np.asarray(source, np.int32)
        if source.ndim != 2 or source.shape[1] != self.max_source_length:
            raise ValueError(f"source must be [rows, max_source_length={self.max_source_length}], got {source.shape}")
        if self.mesh is not None:
            raise ValueError("decoding runs on one device: build the model without mesh (same seed, same "
                             "parameters) or copy its parameters with nnx.update")
        graphdef, state = nnx.split(self)
        outputs = []
        for start in range(0, len(source), batch_size):
            rows = source[start : start + batch_size]
            padded = np.concatenate([rows, np.full((batch_size - len(rows), rows.shape[1]), self.pad_id, np.int32)])
            padded[len(rows):, 0] = self.first_tag
            # Explicit transfers only: the batch's source ids in, its output ids out (the first batch
            # compiles; every later one is a steady-state step).
            with steady_state(warm=start > 0):
                out = _beam_search(graphdef, state, jax.device_put(padded), beam_size, float(alpha), cached)
                outputs.append(jax.device_get(out)[: len(rows)])
        return np.concatenate(outputs) if outputs else np.zeros((0, self.max_target_length), np.int32)


def _texts(texts: Any, name: str) -> list[str]:
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise TypeError(f"{name} must be a sequence of str, got {type(texts).__name__}")
    return list(texts)


def _optimizer(optimizer: Any, learning_rate: float | None) -> optax.GradientTransformation:
    if isinstance(optimizer, optax.GradientTransformation):
        return optimizer
    if not isinstance(optimizer, str):
        raise TypeError(f"optimizer must be 'adafactor', 'adam' or an optax.GradientTransformation, got {optimizer!r}")
    choice(optimizer, "optimizer", OPTIMIZERS)
    if learning_rate is not None:
        positive_float(learning_rate, "learning_rate")
    if optimizer == "adafactor":  # factored second moments, no first moment (GShard, Shazeer & Stern 2018)
        return optax.adafactor(1e-2 if learning_rate is None else learning_rate)
    return optax.adam(1e-3 if learning_rate is None else learning_rate)


def _pairs_loss(model: TranslationModel, batch: dict) -> tuple[jax.Array, dict]:
    return model.loss_and_metrics(batch["source"], batch["target"], rng=jax.random.wrap_key_data(batch["rng"]))


def _output_mask(model: TranslationModel) -> jax.Array:
    """Tokens the decoder may emit: text ids and end (never padding, begin or a tag)."""
    ids = jnp.arange(model.vocab_size)
    return (ids < model.pad_id) | (ids == model.eos_id)


def _cached_step(model: TranslationModel, cache: dict, tokens: jax.Array, position: jax.Array):
    """One decoder step for ``tokens`` [B] at ``position``: logits [B, vocab], the cache with this
    position's self-attention keys and values written in."""
    x = model._embed(tokens[:, None], jax.lax.dynamic_slice_in_dim(model.target_positions[...], position, 1))
    visible = (jnp.arange(model.max_target_length) <= position)[None, None, None, :]
    keys, values = [], []
    for i, block in enumerate(model.decoder):
        h = block.attention_norm(x)
        new_keys, new_values = block.attention.keys_values(h)
        layer_keys = jax.lax.dynamic_update_slice_in_dim(cache["keys"][i], new_keys, position, axis=2)
        layer_values = jax.lax.dynamic_update_slice_in_dim(cache["values"][i], new_values, position, axis=2)
        keys.append(layer_keys)
        values.append(layer_values)
        x = x + block.attention(h, layer_keys, layer_values, visible)
        x = x + block.cross_attention(block.cross_norm(x), cache["cross_keys"][i], cache["cross_values"][i],
                                      cache["source_mask"][:, None, None, :])
        x = x + _feed_forward(block.ffn, block.ffn_norm(x), None, None, None)[0]  # a group of 1 token: C >= 1
    logits = (model.decoder_norm(x) @ model.embedding[...].T).astype(jnp.float32)[:, 0]
    return logits, dict(cache, keys=keys, values=values)


def _uncached_step(model: TranslationModel, cache: dict, tokens: jax.Array, position: jax.Array):
    """The same step without a cache: the whole decoder re-run on the prefix held in ``cache["inputs"]``
    (later positions are PAD: masked by causality, routed to no expert)."""
    inputs = jax.lax.dynamic_update_slice_in_dim(cache["inputs"], tokens[:, None], position, axis=1)
    logits, _ = model.decode(inputs, cache["encoded"], cache["source_mask"], capacity=model.max_target_length)
    return jax.lax.dynamic_index_in_dim(logits, position, axis=1, keepdims=False), dict(cache, inputs=inputs)


@functools.partial(jax.jit, static_argnames=("graphdef", "beam_size", "alpha", "cached"))
def _beam_search(graphdef, state, source, beam_size: int, alpha: float, cached: bool):
    """Beam search (greedy at ``beam_size=1``) in one ``lax.while_loop``: ids [B, Lt].

    Each step every live beam proposes its ``vocab`` continuations, a finished beam only PAD (its
    score frozen); the best ``beam_size`` by score / lp(length) survive, caches gathered to follow
    them. Stops when every beam has finished or at ``max_target_length``; returns each row's best
    beam by score / lp(length).
    """
    model = nnx.merge(graphdef, state)
    batch, length, k = source.shape[0], model.max_target_length, beam_size
    encoded, source_mask, _ = model.encode(source, capacity=source.shape[1])  # C = S: no drops
    tile = lambda x: jnp.repeat(x, k, axis=0)  # noqa: E731  [B, ...] -> [B * K, ...]
    encoded, source_mask = tile(encoded), tile(source_mask)
    if cached:
        cache = {"source_mask": source_mask, "keys": [], "values": [], "cross_keys": [], "cross_values": []}
        for block in model.decoder:
            cross_keys, cross_values = block.cross_attention.keys_values(encoded)
            cache["cross_keys"].append(cross_keys)
            cache["cross_values"].append(cross_values)
            cache["keys"].append(jnp.zeros(cross_keys.shape[:2] + (length,) + cross_keys.shape[3:], encoded.dtype))
            cache["values"].append(jnp.zeros_like(cache["keys"][-1]))
        step_fn = _cached_step
    else:
        cache = {"encoded": encoded, "source_mask": source_mask,
                 "inputs": jnp.full((batch * k, length), model.pad_id, jnp.int32)}
        step_fn = _uncached_step
    allowed = _output_mask(model)
    pad_id, eos_id = model.pad_id, model.eos_id
    vocab = model.vocab_size
    scores = jnp.tile(jnp.asarray([0.0] + [-1e9] * (k - 1), jnp.float32), (batch, 1))  # [B, K]
    carry = dict(
        position=jnp.asarray(0), tokens=jnp.full((batch * k,), model.bos_id, jnp.int32), cache=cache, scores=scores,
        lengths=jnp.zeros((batch, k), jnp.int32), finished=jnp.zeros((batch, k), bool),
        out=jnp.full((batch, k, length), pad_id, jnp.int32),
    )

    def cond(carry):
        return (carry["position"] < length) & ~jnp.all(carry["finished"])

    def body(carry):
        position = carry["position"]
        logits, cache = step_fn(model, carry["cache"], carry["tokens"], position)
        log_probs = jax.nn.log_softmax(jnp.where(allowed, logits, -1e30), axis=-1).reshape(batch, k, vocab)
        finished = carry["finished"]
        pad_only = jnp.where(jnp.arange(vocab) == pad_id, 0.0, -1e30)
        candidates = carry["scores"][..., None] + jnp.where(finished[..., None], pad_only, log_probs)
        lengths = jnp.where(finished, carry["lengths"], position + 1)
        ranked = candidates / length_penalty(lengths, alpha)[..., None]
        _, best = jax.lax.top_k(ranked.reshape(batch, k * vocab), k)  # [B, K]
        beam, token = best // vocab, best % vocab
        take = lambda x: jnp.take_along_axis(x, beam.reshape(beam.shape + (1,) * (x.ndim - 2)), axis=1)  # noqa: E731
        rows = (jnp.arange(batch)[:, None] * k + beam).reshape(-1)  # flat beam rows to follow
        was_finished = take(finished)
        out = take(carry["out"]).at[:, :, position].set(token)
        return dict(
            position=position + 1, tokens=token.reshape(-1).astype(jnp.int32),
            cache=jax.tree.map(lambda x: x[rows] if x.ndim and x.shape[0] == batch * k else x, cache),
            scores=jnp.take_along_axis(candidates.reshape(batch, k * vocab), best, axis=1),
            lengths=jnp.where(was_finished, take(carry["lengths"]), position + 1),
            finished=was_finished | (token == eos_id), out=out,
        )

    carry = jax.lax.while_loop(cond, body, carry)
    final = carry["scores"] / length_penalty(carry["lengths"], alpha)
    best = jnp.argmax(final, axis=1)
    return jnp.take_along_axis(carry["out"], best[:, None, None], axis=1)[:, 0]


def translation_scores(hypotheses: Sequence[str], references: Sequence[str], languages: Sequence[str],
                       ) -> dict[str, dict[str, float]]:
    """Corpus BLEU and chrF (``sacrebleu``, its default 13a tokenisation) per language, and their
    mean over languages under ``"mean"``: ``{lang: {"bleu", "chrf", "sentences"}}``."""
    import sacrebleu

    if not len(hypotheses) == len(references) == len(languages):
        raise ValueError(f"hypotheses, references and languages must have equal lengths, got "
                         f"{len(hypotheses)}, {len(references)}, {len(languages)}")
    by_language: dict[str, tuple[list[str], list[str]]] = {}
    for hypothesis, reference, language in zip(hypotheses, references, languages):
        hyps, refs = by_language.setdefault(language, ([], []))
        hyps.append(hypothesis)
        refs.append(reference)
    scores = {lang: {"bleu": float(sacrebleu.corpus_bleu(h, [r]).score),
                     "chrf": float(sacrebleu.corpus_chrf(h, [r]).score), "sentences": float(len(h))}
              for lang, (h, r) in sorted(by_language.items())}
    if scores:
        scores["mean"] = {key: float(np.mean([s[key] for s in scores.values()])) for key in ("bleu", "chrf")}
        scores["mean"]["sentences"] = float(len(hypotheses))
    return scores
