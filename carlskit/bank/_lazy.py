"""The CARLS lazy averaged gradient update as pure numpy functions (CARLS paper, section 3.2).

Gradients sent for a key are cached until the next lookup of that key, until the key has
``max_pending`` cached gradients, or until its oldest cached gradient is older than
``pending_ttl_seconds``. Then all cached gradients of the key are combined and applied at once:

1. gradients holding a NaN or Inf are dropped (counted as ``dropped_nonfinite``);
2. when at least 3 gradients remain, a gradient g_i is an outlier and dropped (counted as
   ``dropped_outliers``) when ``||g_i||_2 > median(n) + outlier_threshold * 1.4826 * MAD(n)``,
   where n are the L2 norms of the remaining gradients and ``MAD(n) = median(|n - median(n)|)``
   (1.4826 * MAD estimates the standard deviation of normal data). With MAD = 0 every norm above
   the median is an outlier;
3. the remaining gradients are combined, g = mean_i g_i (``combine="mean"``, the default) or
   g = sum_i g_i (``combine="sum"``), and one optimizer step is taken:
   ``sgd``: v <- v - lr * g;  ``adagrad``: a <- a + g**2, v <- v - lr * g / sqrt(a + eps).
   A key whose gradients were all dropped is left unchanged.

Mean or sum: the mean is right when each gradient is that of a mean loss over its sender's batch
(data-parallel averaging: n trainers' gradients of one row average to the gradient of the mean loss
over their n batches). The sum is right when the loss is a sum over examples (word2vec / DeepWalk's
per-pair SGD, whose gradient of a row is the sum over its uses): with SGD, ``combine="sum"`` gives
exactly the row that applying each gradient on arrival gives (``max_pending=1``), only later, in
one step, with the outliers dropped; averaging instead divides the step of a row by the number of
gradients it cached (two trainers touching it: half the step).

Everything is vectorized over keys: ``groups`` gives, per cached gradient, the index of its key.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

MAD_TO_STD = 1.4826
COMBINES = ("mean", "sum")


class CombinedGradients(NamedTuple):
    """Result of :func:`combine_gradients`."""

    group_index: np.ndarray  # int64 [m]: groups (keys) that received an averaged gradient
    gradient: np.ndarray  # float32 [m, dim]: the combined (mean or summed) gradient of each group
    count: np.ndarray  # int64 [m]: gradients combined per group
    dropped_nonfinite: int
    dropped_outliers: int


def _group_median(values: np.ndarray, groups: np.ndarray, num_groups: int) -> np.ndarray:
    """Median of ``values`` within each group (vectorized; groups without values get NaN)."""
    order = np.lexsort((values, groups))
    sorted_values = values[order]
    counts = np.bincount(groups, minlength=num_groups)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    medians = np.full(num_groups, np.nan)
    has = counts > 0
    low = starts[has] + (counts[has] - 1) // 2
    high = starts[has] + counts[has] // 2
    medians[has] = 0.5 * (sorted_values[low] + sorted_values[high])
    return medians


def combine_gradients(
    gradients: np.ndarray, groups: np.ndarray, num_groups: int, outlier_threshold: float = 3.0,
    combine: str = "mean",
) -> CombinedGradients:
    """Steps 1-2-3 (combining part) of the lazy rule for all groups at once.

    Args:
      gradients: float32 [n, dim] cached gradients, in any order.
      groups: int64 [n] key index (0..num_groups-1) of each gradient.
      num_groups: number of keys.
      outlier_threshold: k in ``median + k * 1.4826 * MAD``.
      combine: ``"mean"`` or ``"sum"`` of each group's remaining gradients.
    """
    if combine not in COMBINES:
        raise ValueError(f"combine must be one of {COMBINES}, got {combine!r}")
    dropped_nonfinite = 0
    # a row's sum is finite only if every entry is (overflow aside): one pass, no [n, dim] mask
    with np.errstate(invalid="ignore", over="ignore"):  # inf + -inf: NaN, which is the point
        suspect = np.flatnonzero(~np.isfinite(np.add.reduce(gradients, axis=1, dtype=np.float64)))
    if len(suspect):
        finite = np.ones(len(gradients), bool)
        finite[suspect] = np.isfinite(gradients[suspect]).all(axis=1)
        dropped_nonfinite = int(len(finite) - finite.sum())
        if dropped_nonfinite:
            gradients, groups = gradients[finite], groups[finite]
    counts = np.bincount(groups, minlength=num_groups)
    dropped_outliers = 0
    if len(groups) and counts.max() >= 3:
        candidates = np.flatnonzero(counts[groups] >= 3)  # the rule only looks at these keys
        sub_gradients, sub_groups = gradients[candidates], groups[candidates]
        norms = np.sqrt(np.einsum("ij,ij->i", sub_gradients, sub_gradients, dtype=np.float64))
        median = _group_median(norms, sub_groups, num_groups)
        mad = _group_median(np.abs(norms - median[sub_groups]), sub_groups, num_groups)
        limit = median + outlier_threshold * MAD_TO_STD * mad
        outlier = candidates[norms > limit[sub_groups]]
        dropped_outliers = len(outlier)
        if dropped_outliers:
            keep = np.ones(len(groups), dtype=bool)
            keep[outlier] = False
            gradients, groups = gradients[keep], groups[keep]
            counts = np.bincount(groups, minlength=num_groups)
    group_index = np.flatnonzero(counts)
    if len(groups) and (groups[1:] > groups[:-1]).all():  # one gradient per key, in key order: as is
        return CombinedGradients(group_index, gradients.astype(np.float32, copy=False), counts[group_index],
                                 dropped_nonfinite, dropped_outliers)
    order = np.argsort(groups, kind="stable")
    sorted_gradients = gradients[order]
    group_counts = counts[group_index]
    if len(groups) == len(group_index):  # one gradient per key: the common case, no reduction
        mean = sorted_gradients
    else:  # each key's run of the sorted gradients summed in float64 (one pass, no running sum)
        starts = np.cumsum(group_counts) - group_counts
        sums = np.add.reduceat(sorted_gradients, starts, axis=0, dtype=np.float64)
        mean = sums / group_counts[:, None] if combine == "mean" else sums
    return CombinedGradients(
        group_index, mean.astype(np.float32, copy=False), counts[group_index],
        dropped_nonfinite, dropped_outliers,
    )


def sgd_step(values: np.ndarray, gradient: np.ndarray, learning_rate: float) -> np.ndarray:
    """v <- v - lr * g."""
    return values - np.float32(learning_rate) * gradient


def adagrad_step(
    values: np.ndarray, accumulator: np.ndarray, gradient: np.ndarray, learning_rate: float,
    epsilon: float,
) -> tuple[np.ndarray, np.ndarray]:
    """a <- a + g**2; v <- v - lr * g / sqrt(a + eps) (Duchi et al. 2011). Returns (v, a), new
    arrays (two allocations: the update runs in place in them, not in one temporary per term)."""
    new_accumulator = np.multiply(gradient, gradient, dtype=np.float32)
    new_accumulator += accumulator
    step = np.add(new_accumulator, np.float32(epsilon))
    np.sqrt(step, out=step)
    np.divide(gradient, step, out=step)
    step *= np.float32(learning_rate)
    np.subtract(values, step, out=step)
    return step, new_accumulator
