"""Exact and approximate top-k search over a shard's row array, and the top-k merge helper.

Scores: ``dot`` = <q, v> and ``cosine`` = <q, v> / (|q| |v|), larger is better; ``l2`` = |q - v|^2
(squared distance, as faiss reports it), smaller is better. Missing results are padded with key -1
and score -inf (dot, cosine) or +inf (l2).

The exact search calls faiss' flat kNN kernels (``faiss.knn``, the code behind ``IndexFlatIP`` /
``IndexFlatL2``) directly on the shard's preallocated value array, so there is no second copy of
the vectors and every write is visible to the next query with no index maintenance at all.
Cosine uses blocked BLAS matrix products divided by the stored row norms. Faiss runs its kernels
with OpenMP threads; Dask workers set ``OMP_NUM_THREADS=1``, so inside a worker each shard searches
single-threaded and parallelism comes from the shards.
"""

from __future__ import annotations

import faiss
import numpy as np

METRICS = ("dot", "cosine", "l2")
_COSINE_BLOCK_ROWS = 65536


def larger_is_better(metric: str) -> bool:
    return metric != "l2"


def worst_score(metric: str) -> float:
    return -np.inf if larger_is_better(metric) else np.inf


def top_k(keys: np.ndarray, scores: np.ndarray, k: int, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """Best k per row of candidate ``keys``/``scores`` [nq, c] (padding with -1 / worst score)."""
    nq, c = scores.shape
    if c < k:
        pad = k - c
        keys = np.concatenate([keys, np.full((nq, pad), -1, dtype=np.int64)], axis=1)
        scores = np.concatenate([scores, np.full((nq, pad), worst_score(metric), np.float32)], axis=1)
        c = k
    order_key = -scores if larger_is_better(metric) else scores
    if c > k:
        part = np.argpartition(order_key, k - 1, axis=1)[:, :k]
        keys = np.take_along_axis(keys, part, axis=1)
        scores = np.take_along_axis(scores, part, axis=1)
        order_key = np.take_along_axis(order_key, part, axis=1)
    order = np.argsort(order_key, axis=1, kind="stable")
    return np.take_along_axis(keys, order, axis=1), np.take_along_axis(scores, order, axis=1)


def exact_search(
    queries: np.ndarray, vectors: np.ndarray, norms: np.ndarray, k: int, metric: str
) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k rows (int64 [nq, k], -1 padded) and scores of ``queries`` against ``vectors``."""
    n = len(vectors)
    k_eff = min(k, n)
    if k_eff == 0:
        return (np.full((len(queries), k), -1, np.int64),
                np.full((len(queries), k), worst_score(metric), np.float32))
    if metric == "dot":
        scores, rows = faiss.knn(queries, vectors, k_eff, metric=faiss.METRIC_INNER_PRODUCT)
    elif metric == "l2":
        scores, rows = faiss.knn(queries, vectors, k_eff, metric=faiss.METRIC_L2)
    else:
        rows, scores = _cosine_search(queries, vectors, norms, k_eff)
    return top_k(rows.astype(np.int64), scores.astype(np.float32), k, metric)


def _cosine_search(queries, vectors, norms, k):
    q = queries / np.maximum(np.linalg.norm(queries, axis=1, keepdims=True), 1e-30)
    q = q.astype(np.float32)
    best_rows = np.empty((len(q), 0), np.int64)
    best_scores = np.empty((len(q), 0), np.float32)
    for start in range(0, len(vectors), _COSINE_BLOCK_ROWS):
        block = vectors[start:start + _COSINE_BLOCK_ROWS]
        scores = q @ block.T
        scores /= np.maximum(norms[start:start + len(block)], 1e-30)[None, :]
        rows = np.broadcast_to(np.arange(start, start + len(block), dtype=np.int64), scores.shape)
        rows, scores = top_k(rows, scores, min(k, len(block)), "cosine")
        best_rows, best_scores = top_k(
            np.concatenate([best_rows, rows], 1), np.concatenate([best_scores, scores], 1), k, "cosine")
    return best_rows, best_scores


class HNSWIndex:
    """Approximate search (faiss ``IndexHNSWFlat``) kept current without full rebuilds.

    Rows appended since the build are added to the graph incrementally before the next query. Rows
    whose value changed after they were added (``update`` or an applied gradient) are marked dirty:
    queries ask the graph for ``k + #dirty`` results, drop the dirty ones and merge an exact search
    over the dirty rows. When more than ``rebuild_fraction`` of the rows are dirty the graph is
    rebuilt from scratch.
    """

    def __init__(self, dim: int, metric: str, m: int = 32, ef_search: int = 64,
                 rebuild_fraction: float = 0.05) -> None:
        self.dim, self.metric, self.m, self.ef_search = dim, metric, m, ef_search
        self.rebuild_fraction = rebuild_fraction
        self._reset()

    def _reset(self) -> None:
        faiss_metric = faiss.METRIC_L2 if self.metric == "l2" else faiss.METRIC_INNER_PRODUCT
        self.index = faiss.IndexHNSWFlat(self.dim, self.m, faiss_metric)
        self.index.hnsw.efSearch = self.ef_search
        self.num_indexed = 0
        self.dirty = np.zeros(0, dtype=bool)

    def mark_dirty(self, rows: np.ndarray) -> None:
        rows = rows[rows < self.num_indexed]
        if len(rows):
            self.dirty[rows] = True

    def _prepared(self, vectors: np.ndarray) -> np.ndarray:
        if self.metric != "cosine":
            return np.ascontiguousarray(vectors, dtype=np.float32)
        norms = np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-30)
        return np.ascontiguousarray(vectors / norms, dtype=np.float32)

    def search(self, queries: np.ndarray, vectors: np.ndarray, norms: np.ndarray, k: int):
        n = len(vectors)
        num_dirty = int(self.dirty.sum())
        if num_dirty > self.rebuild_fraction * max(n, 1) and num_dirty > 64:
            self._reset()
        if n > self.num_indexed:
            self.index.add(self._prepared(vectors[self.num_indexed:n]))
            self.dirty = np.concatenate([self.dirty, np.zeros(n - self.num_indexed, dtype=bool)])
            self.num_indexed = n
        dirty_rows = np.flatnonzero(self.dirty)
        q = self._prepared(queries)
        k_graph = min(k + len(dirty_rows), n)
        scores, rows = self.index.search(q, k_graph) if k_graph else (
            np.empty((len(q), 0), np.float32), np.empty((len(q), 0), np.int64))
        rows = rows.astype(np.int64)
        if len(dirty_rows):
            stale = (rows >= 0) & self.dirty[np.maximum(rows, 0)]
            rows = np.where(stale, -1, rows)
            scores = np.where(stale, worst_score(self.metric), scores).astype(np.float32)
            fresh_rows, fresh_scores = exact_search(
                queries, np.ascontiguousarray(vectors[dirty_rows]), norms[dirty_rows],
                min(k, len(dirty_rows)), self.metric)
            fresh_rows = np.where(fresh_rows >= 0, dirty_rows[np.maximum(fresh_rows, 0)], -1)
            rows = np.concatenate([rows, fresh_rows], 1)
            scores = np.concatenate([scores, fresh_scores], 1)
        rows = np.where(rows >= 0, rows, -1)
        scores = np.where(rows >= 0, scores, worst_score(self.metric)).astype(np.float32)
        return top_k(rows, scores, k, self.metric)
