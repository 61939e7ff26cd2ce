"""Knowledge stages for the trainer's input pipeline: read neighbour records, then their embeddings."""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from carlskit._checks import instance, integer, positive_int
from carlskit.bank import ShardLostError
from carlskit.training._pipeline import Batch


def with_bank_recovery(knowledge: Callable[[Batch], Batch] | None,
                       recoveries: list[dict]) -> Callable[[Batch], Batch] | None:
    """``knowledge`` that survives a lost bank shard (used by ``Trainer.fit``).

    When a stage raises :class:`carlskit.bank.ShardLostError` and the bank that raised it keeps
    snapshots (``KnowledgeBank.enable_snapshots``), the bank's ``recover()`` rebuilds the lost shard
    from the latest snapshot (plus its write-ahead log, if on) and the batch is enriched again; each
    recovery is appended to ``recoveries`` (shards, seconds, what ``recover()`` reported). Without
    snapshots there is nothing to rebuild from: a ShardLostError saying so is raised (``fit`` then
    publishes a checkpoint of the last finished step and stops).
    """
    if knowledge is None:
        return None

    def stage(batch: Batch) -> Batch:
        try:
            return knowledge(batch)
        except ShardLostError as error:
            bank = error.bank
            if bank is None or not bank.recoverable:
                raise ShardLostError(f"the knowledge pipeline lost bank shard {error.shard} and the "
                                     f"bank keeps no snapshots to rebuild it from (call "
                                     f"KnowledgeBank.enable_snapshots before training): {error}",
                                     shard=error.shard) from error
            start = time.perf_counter()
            report = bank.recover()
            recoveries.append({"shards": sorted(report), "seconds": time.perf_counter() - start,
                               "report": report})
            return knowledge(batch)

    return stage


def _batch_ids(batch: Batch, key: str, stage: str) -> np.ndarray:
    """``batch[key]`` as int64 item ids [B]; a missing key, a float or a non-1-D array is an error
    (casting floats would silently look up truncated ids)."""
    if not isinstance(batch, dict) or key not in batch:
        have = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
        raise ValueError(f"{stage} reads item ids from batch[{key!r}], which the batch lacks (it has {have})")
    ids = np.asarray(batch[key])
    if ids.dtype.kind not in "iu":
        raise TypeError(f"{stage}: batch[{key!r}] must hold int item ids, got dtype {ids.dtype}")
    if ids.ndim != 1:
        raise ValueError(f"{stage}: batch[{key!r}] must be 1-D item ids [B], got shape {ids.shape}")
    return ids.astype(np.int64)


def check_embedding_dim(bank: Any, table: str, dim: int) -> None:
    """Raise ``ValueError`` at start-up when a model's embedding size differs from the bank table's."""
    expected = bank.table_config(table, "embedding").dim
    if expected != dim:
        raise ValueError(f"the model's embedding dim {dim} differs from bank table {table!r}'s dim {expected}")


class NeighborKnowledge:
    """Add each item's neighbours and their bank embeddings to a batch (CARLS figure 2).

    For ``batch[key]`` (item ids [B]) it looks up the neighbour records ``records_table``
    (fields ``ids`` [W] int64 padded with -1 and ``weights`` [W] float32), keeps the first
    ``max_neighbors``, then looks up the embeddings of all distinct neighbours from
    ``embeddings_table`` in one batched call. It adds:

    - ``neighbor_embeddings`` [B, K, D] float32 and ``neighbor_weights`` [B, K] float32; padding and
      neighbours absent from the bank get weight 0 (skipped, not a crash);
    - ``_missing_neighbors``: how many real neighbours were absent, and ``_embedding_version``: the
      mean model version of the embeddings read (the trainer logs step minus it as staleness),
      ``_oldest_embedding_version`` the oldest one, and ``_neighbor_ids`` / ``_neighbor_versions``
      [B, K] (host-side, -1 where no usable neighbour) for stages that act on stale rows.

    Three batched bank calls per batch (records, embeddings, embedding versions), whatever K is.
    """

    def __init__(self, bank: Any, *, max_neighbors: int, records_table: str = "nbrs",
                 embeddings_table: str = "emb", key: str = "ids"):
        max_neighbors = positive_int(max_neighbors, "max_neighbors")
        width = bank.table_config(records_table, "feature", ("ids", "weights")).fields["ids"][1]
        dim = bank.table_config(embeddings_table, "embedding").dim
        if max_neighbors > width:
            raise ValueError(f"max_neighbors {max_neighbors} exceeds the {records_table!r} record width {width}")
        self.bank = bank
        self.max_neighbors = max_neighbors
        self.records_table = records_table
        self.embeddings_table = embeddings_table
        self.key = key
        self.dim = dim
        self.missing_total = 0

    def __call__(self, batch: Batch) -> Batch:
        ids = _batch_ids(batch, self.key, "NeighborKnowledge")
        records, found = self.bank.lookup(self.records_table, ids)
        neighbors = records["ids"][:, : self.max_neighbors]
        weights = records["weights"][:, : self.max_neighbors] * found[:, None]
        real = (neighbors >= 0) & found[:, None]
        unique, inverse = np.unique(np.where(real, neighbors, -1), return_inverse=True)
        inverse = inverse.reshape(neighbors.shape)
        lookup_keys = unique[unique >= 0]
        offset = len(unique) - len(lookup_keys)  # 1 when -1 (padding) is among the unique values
        embeddings = np.zeros((len(unique), self.dim), np.float32)
        present = np.zeros(len(unique), bool)
        version = oldest = np.nan
        row_versions = np.full(len(unique), -1, np.int64)
        if len(lookup_keys):
            values, exists = self.bank.lookup(self.embeddings_table, lookup_keys)
            embeddings[offset:], present[offset:] = values, exists
            if exists.any():
                versions = self.bank.row_metadata(self.embeddings_table, lookup_keys[exists])["version"]
                version, oldest = float(np.mean(versions)), float(np.min(versions))
                row_versions[offset:][exists] = versions
        usable = real & present[inverse]
        missing = int(real.sum() - usable.sum())
        self.missing_total += missing
        return {
            **batch,
            "neighbor_embeddings": embeddings[inverse],
            "neighbor_weights": np.where(usable, weights, 0.0).astype(np.float32),
            "_missing_neighbors": missing,
            "_embedding_version": version,
            "_oldest_embedding_version": oldest,
            # host-side only (not scalars, so neither the step nor the history sees them): which
            # neighbour each slot holds (-1: none usable) and its embedding's model version
            "_neighbor_ids": np.where(usable, neighbors, -1),
            "_neighbor_versions": np.where(usable, row_versions[inverse], -1),
        }


class MinedLabels:
    """Add each item's mined label and confidence from the bank to a batch (CARLS 4.2.1).

    For ``batch[key]`` (item ids [B]) it looks up the label maker's records in ``table`` (fields
    ``label`` [1] int64 and ``confidence`` [1] float32) in one batched call and adds
    ``mined_labels`` [B] int32 and ``mined_confidence`` [B] float32 (items the maker has not labelled
    yet get label 0 with confidence 0, so no threshold in (0, 1] selects them), and
    ``_mined_version``: the mean model version of the labels read (NaN when none exists yet).
    """

    def __init__(self, bank: Any, table: str = "labels", key: str = "ids"):
        bank.table_config(table, "feature", ("label", "confidence"))
        self.bank, self.table, self.key = bank, table, key

    def __call__(self, batch: Batch) -> Batch:
        ids = _batch_ids(batch, self.key, "MinedLabels")
        records, found = self.bank.lookup(self.table, ids)
        version = np.nan
        if found.any():
            version = float(np.mean(self.bank.row_metadata(self.table, ids[found])["version"]))
        return {
            **batch,
            "mined_labels": np.where(found, np.maximum(records["label"][:, 0], 0), 0).astype(np.int32),
            "mined_confidence": np.where(found, records["confidence"][:, 0], 0.0).astype(np.float32),
            "_mined_version": version,
        }


class BankNegatives:
    """Add ``num_negatives`` contrastive negatives, read from the bank, to a batch (CARLS 4.3).

    For ``batch[key]`` (the ids of the batch's positive pairs [B]) it draws ``num_negatives``
    distinct keys uniformly from ``candidates`` without the batch's ids (so no negative is a
    positive of the batch) and reads, in one batched lookup per table of ``tables`` (``{table:
    name}``, e.g. ``{"text_emb": "texts"}``), the negatives' and the batch items' own embeddings:

    - ``negative_<name>`` [N, D] float32 and ``negative_mask`` [N] bool (found in every table;
      negatives the maker has not written yet are masked out, not a crash);
    - ``bank_<name>`` [B, D] float32: the batch items' own bank embeddings, computed by the same
      (stale) checkpoints as the negatives, and ``bank_mask`` [B] bool;
    - ``negative_ids`` [N] int64 and ``_embedding_version``: the mean model version of the
      embeddings read (the trainer logs step minus it as staleness).

    All of these are constants to the trainer (the maker computed them). ``num_negatives`` is
    fixed, so the step compiles once whatever the batch.
    """

    def __init__(self, bank: Any, tables: dict[str, str], *, num_negatives: int, candidates: Any,
                 key: str = "ids", seed: int = 0):
        if not instance(tables, "tables", dict, "a non-empty dict {table: name}"):
            raise ValueError(f"tables must be a non-empty dict {{table: name}}, got {tables!r}")
        for table in tables:
            bank.table_config(table, "embedding")
        candidates = np.unique(np.asarray(candidates))
        if candidates.ndim != 1 or candidates.dtype.kind not in "iu" or len(candidates) == 0:
            raise ValueError(f"candidates must be a non-empty 1-D array of int keys, got {candidates.dtype} "
                             f"{candidates.shape}")
        num_negatives = integer(num_negatives, "num_negatives", 1, len(candidates) - 1)
        self.bank, self.tables, self.key = bank, dict(tables), key
        self.num_negatives = num_negatives
        self.candidates = candidates.astype(np.int64)
        self._rng = np.random.default_rng(seed)

    def sample(self, positives: np.ndarray) -> np.ndarray:
        """``num_negatives`` distinct candidate keys, none of them in ``positives``."""
        positives = np.asarray(positives, dtype=np.int64)
        draw = min(self.num_negatives + len(positives), len(self.candidates))
        keys = self.candidates[self._rng.choice(len(self.candidates), draw, replace=False)]
        keys = keys[~np.isin(keys, positives)]
        if len(keys) < self.num_negatives:
            raise ValueError(f"only {len(keys)} candidates remain besides the batch's {len(positives)} positives; "
                             f"num_negatives is {self.num_negatives}")
        return keys[: self.num_negatives]

    def __call__(self, batch: Batch) -> Batch:
        positives = _batch_ids(batch, self.key, "BankNegatives")
        negatives = self.sample(positives)
        keys = np.concatenate([negatives, positives])
        found = np.ones(len(keys), bool)
        out = {**batch, "negative_ids": negatives}
        n = len(negatives)
        for table, name in self.tables.items():
            values, exists = self.bank.lookup(table, keys)
            out[f"negative_{name}"], out[f"bank_{name}"] = values[:n], values[n:]
            found &= exists
        version = np.nan
        if found.any():
            first = next(iter(self.tables))
            version = float(np.mean(self.bank.row_metadata(first, keys[found])["version"]))
        out["negative_mask"], out["bank_mask"] = found[:n], found[n:]
        out["_embedding_version"] = version
        return out
