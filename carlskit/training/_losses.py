"""Pure loss functions for the CARLS paradigms (jit- and vmap-able, plain arrays in and out)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

DISTANCES = ("l2", "l1", "cosine")


def pairwise_distance(samples: jax.Array, neighbors: jax.Array, distance: str = "l2") -> jax.Array:
    """Distance between each sample [B, D] and each of its neighbours [B, K, D]; returns [B, K].

    ``l2``: squared Euclidean, sum_d (x_d - n_d)^2; ``l1``: sum_d |x_d - n_d|;
    ``cosine``: 1 - <x, n> / (|x| |n|) (Neural Structured Learning's distance options).
    """
    if distance not in DISTANCES:
        raise ValueError(f"distance must be one of {DISTANCES}, got {distance!r}")
    if samples.ndim != 2 or neighbors.ndim != 3 or neighbors.shape[0] != samples.shape[0] \
            or neighbors.shape[2] != samples.shape[1]:  # a [1, K, D] would broadcast silently
        raise ValueError(f"expected samples [B, D] and neighbors [B, K, D] of the same B and D; got "
                         f"samples {samples.shape}, neighbors {neighbors.shape}")
    difference = samples[:, None, :] - neighbors
    if distance == "l2":
        return jnp.sum(difference**2, axis=-1)
    if distance == "l1":
        return jnp.sum(jnp.abs(difference), axis=-1)
    dot = jnp.einsum("bd,bkd->bk", samples, neighbors)
    norms = jnp.linalg.norm(samples, axis=-1)[:, None] * jnp.linalg.norm(neighbors, axis=-1)
    return 1.0 - dot / jnp.maximum(norms, 1e-12)


def graph_regularization(
    samples: jax.Array, neighbors: jax.Array, weights: jax.Array, distance: str = "l2"
) -> jax.Array:
    """Graph regularizer of CARLS figure 2 / Neural Structured Learning.

    mean over samples of sum_k weights[b, k] * distance(samples[b], neighbors[b, k]).
    ``neighbors`` are the bank's embeddings of the neighbours (constants: no gradient flows into
    them); padding and neighbours missing from the bank carry weight 0.
    """
    if samples.ndim != 2 or neighbors.ndim != 3 or weights.shape != (samples.shape[0], neighbors.shape[1]) \
            or neighbors.shape[::2] != samples.shape:
        raise ValueError(
            f"expected samples [B, D], neighbors [B, K, D], weights [B, K]; got samples {samples.shape}, "
            f"neighbors {neighbors.shape}, weights {weights.shape}"
        )
    distances = pairwise_distance(samples, jax.lax.stop_gradient(neighbors), distance)
    return jnp.mean(jnp.sum(weights * distances, axis=-1))


def masked_cross_entropy(logits: jax.Array, labels: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy over the items where ``mask`` is true (0 when none is).

    ``logits`` [B, C], ``labels`` [B] int, ``mask`` [B]: mean over {i: mask_i} of -log softmax(logits_i)[labels_i].
    """
    if logits.ndim != 2 or jnp.shape(labels) != logits.shape[:1] or jnp.shape(mask) != logits.shape[:1]:
        raise ValueError(f"expected logits [B, C], labels [B] and mask [B]; got logits {logits.shape}, "
                         f"labels {jnp.shape(labels)}, mask {jnp.shape(mask)}")
    if not jnp.issubdtype(jnp.result_type(labels), jnp.integer):
        raise TypeError(f"labels must be int class indices, got dtype {jnp.result_type(labels)}")
    safe_labels = jnp.where(mask, labels, 0)
    losses = -jnp.take_along_axis(jax.nn.log_softmax(logits), safe_labels[:, None], axis=-1)[:, 0]
    mask = mask.astype(logits.dtype)
    return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def select_mined_labels(given: jax.Array, mined: jax.Array, confidence: jax.Array,
                        threshold: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Training targets of online label mining (CARLS section 4.2.1).

    target_i = mined_i if confidence_i > threshold else given_i; also returns the boolean mask of
    items whose mined label was used. ``threshold`` is a scalar array (a schedule value fed per
    batch, so changing it never recompiles).
    """
    if given.shape != mined.shape or given.shape != confidence.shape or jnp.ndim(threshold) != 0:
        raise ValueError(f"expected given, mined and confidence [B] and a scalar threshold; got {given.shape}, "
                         f"{mined.shape}, {confidence.shape}, {jnp.shape(threshold)}")
    use_mined = confidence > threshold
    return jnp.where(use_mined, mined, given), use_mined


def info_nce(queries: jax.Array, positives: jax.Array, negatives: jax.Array | None = None,
             negative_mask: jax.Array | None = None, temperature: float | jax.Array = 0.1) -> jax.Array:
    """InfoNCE with cosine scores over in-batch positives and bank negatives (CARLS 4.3, ALIGN).

    With s(a, b) = <a, b> / (|a| |b|) / temperature, for query i the candidates are every positive
    j of the batch (j != i are its in-batch negatives) and every bank negative m::

        loss = mean_i -log( exp s(q_i, p_i) / (sum_j exp s(q_i, p_j) + sum_m mask_m exp s(q_i, n_m)) )

    ``queries``, ``positives`` [B, D]; ``negatives`` [N, D] shared by the batch (constants: no
    gradient flows into them, as in CARLS and MoCo memory banks); ``negative_mask`` [N] bool drops
    negatives (e.g. not yet in the bank).
    """
    if queries.ndim != 2 or positives.shape != queries.shape:
        raise ValueError(f"expected queries and positives [B, D] of one shape, got {queries.shape}, {positives.shape}")
    if isinstance(temperature, (int, float)) and not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    queries, positives = _unit(queries), _unit(positives)
    logits = queries @ positives.T / temperature
    if negatives is not None:
        if negatives.ndim != 2 or negatives.shape[1] != queries.shape[1]:
            raise ValueError(f"expected negatives [N, {queries.shape[1]}], got {negatives.shape}")
        scores = queries @ _unit(jax.lax.stop_gradient(negatives)).T / temperature
        if negative_mask is not None:
            if negative_mask.shape != negatives.shape[:1]:
                raise ValueError(f"expected negative_mask [{negatives.shape[0]}], got {negative_mask.shape}")
            scores = jnp.where(negative_mask, scores, -jnp.inf)
        logits = jnp.concatenate([logits, scores], axis=1)
    log_probabilities = jax.nn.log_softmax(logits, axis=1)
    return -jnp.mean(jnp.diagonal(log_probabilities))


def _unit(x: jax.Array) -> jax.Array:
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
