"""CARLS headline: trainer step time as the neighbour count K grows (paper: 10x larger neighbourhoods
with no slowdown).

Two modes, same MLP, same batch of B items, K neighbours each:
- bank:     neighbour embeddings are read from the knowledge bank (written by an embedding maker from
            the latest checkpoint); the trainer's step only encodes the B items.
- baseline: the trainer encodes all B*K neighbours' features inside its step (NSL-style).
Time per step includes the input pipeline (fit wall time / steps, after a compile warm-up).
A final bank-mode run with a live embedding maker reports embedding staleness (trainer step minus
the version of the embeddings it read).

    python benchmarks/graph_neighbors.py [--small]
Last line: JSON with bank_t100_over_t1, baseline_t100_over_t1, per-K times and staleness.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from carlskit.bank import KnowledgeBank
from carlskit.makers import EmbeddingMaker, Maker
from carlskit.paradigms.graph_reg import MLP, encode
from carlskit.training import CheckpointStore, NeighborKnowledge, Trainer, graph_regularization, masked_cross_entropy

NUM_ITEMS, NUM_FEATURES, HIDDEN, NUM_CLASSES = 2708, 1433, 64, 7  # Cora's shape


def bank_loss(model, batch):
    logits = model(batch["features"])
    supervised = masked_cross_entropy(logits, batch["labels"], batch["labelled"])
    samples = model.embed(batch["features"])["emb"]
    return supervised + graph_regularization(samples, batch["neighbor_embeddings"], batch["neighbor_weights"]), {}


def baseline_loss(model, batch):
    logits = model(batch["features"])
    supervised = masked_cross_entropy(logits, batch["labels"], batch["labelled"])
    samples = model.embed(batch["features"])["emb"]
    b, k, d = batch["neighbor_features"].shape
    neighbors = jax.lax.stop_gradient(model.embed(batch["neighbor_features"].reshape(b * k, d))["emb"])
    return supervised + graph_regularization(samples, neighbors.reshape(b, k, -1), batch["neighbor_weights"]), {}


def make_data(k: int, batch_size: int, features: np.ndarray, labels: np.ndarray, neighbors: np.ndarray,
              with_neighbor_features: bool):
    rng = np.random.default_rng(0)

    def batch(step):
        ids = rng.choice(NUM_ITEMS, batch_size, replace=False)
        out = {"ids": ids, "features": features[ids], "labels": labels[ids], "labelled": np.ones(batch_size, bool)}
        if with_neighbor_features:
            nbrs = neighbors[ids, :k]
            out["neighbor_features"] = features[nbrs]
            out["neighbor_weights"] = np.full((batch_size, k), 1.0 / k, np.float32)
        return out

    return batch


def time_fit(trainer: Trainer, data, steps: int, warmup: int) -> float:
    trainer.fit(data, warmup, progress=False, live=False)
    start = time.perf_counter()
    trainer.fit(data, steps, progress=False, live=False)
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    args = parser.parse_args()
    small = args.small or os.environ.get("CARLSKIT_SMALL") == "1"
    ks = [1, 10, 30, 100]
    # The same batch in both sizes: the bank's lookups hide behind a step only when the step has
    # work to hide them behind, so a smaller batch would measure a different regime.
    batch_size = 128
    steps, warmup = (10, 3) if small else (30, 5)
    rng = np.random.default_rng(0)
    features = (rng.random((NUM_ITEMS, NUM_FEATURES)) < 0.01).astype(np.float32)
    labels = rng.integers(0, NUM_CLASSES, NUM_ITEMS)
    neighbors = rng.integers(0, NUM_ITEMS, (NUM_ITEMS, max(ks)))
    make_model = functools.partial(MLP, NUM_FEATURES, HIDDEN, NUM_CLASSES, dropout=0.5, seed=0)

    bank = KnowledgeBank()
    bank.create_table("emb", dim=NUM_CLASSES, initializer="zeros")
    bank.create_feature_table("nbrs", schema={"ids": ("int64", max(ks)), "weights": ("float32", max(ks))})
    items = np.arange(NUM_ITEMS)
    bank.update("nbrs", items, {"ids": neighbors, "weights": np.ones_like(neighbors, np.float32)}, version=0)
    model = make_model()
    bank.update("emb", items, np.asarray(encode(model, jnp.asarray(features))["emb"]), version=0)

    results: dict = {"batch_size": batch_size, "ks": ks, "bank_step_s": {}, "baseline_step_s": {}}
    for k in ks:
        trainer = Trainer(make_model(), optax.adam(1e-3), bank_loss, knowledge=NeighborKnowledge(bank, max_neighbors=k))
        results["bank_step_s"][k] = time_fit(trainer, make_data(k, batch_size, features, labels, neighbors, False),
                                             steps, warmup)
        trainer = Trainer(make_model(), optax.adam(1e-3), baseline_loss)
        results["baseline_step_s"][k] = time_fit(trainer, make_data(k, batch_size, features, labels, neighbors, True),
                                                 steps, warmup)
        print(f"K={k:4d}  bank {results['bank_step_s'][k] * 1e3:8.2f} ms/step   "
              f"baseline {results['baseline_step_s'][k] * 1e3:8.2f} ms/step", file=sys.stderr, flush=True)
    results["bank_t100_over_t1"] = results["bank_step_s"][100] / results["bank_step_s"][1]
    results["baseline_t100_over_t1"] = results["baseline_step_s"][100] / results["baseline_step_s"][1]

    # Staleness over a run with a live embedding maker (checkpoint every 5 steps).
    with tempfile.TemporaryDirectory() as directory:
        store = CheckpointStore(directory, keep=3)
        trainer = Trainer(make_model(), optax.adam(1e-3), bank_loss,
                          knowledge=NeighborKnowledge(bank, max_neighbors=10),
                          checkpoints=store, checkpoint_every=5)
        trainer.save_checkpoint()
        maker = Maker(EmbeddingMaker(make_model, encode, features), items, poll_seconds=0.01).start(store, bank)
        try:
            trainer.fit(make_data(10, batch_size, features, labels, neighbors, False), 4 * steps,
                        progress=False, live=False)
        finally:
            maker.stop()
        staleness = np.array([r["staleness"] for r in trainer.history if np.isfinite(r.get("staleness", np.nan))])
        results["staleness_mean"] = float(staleness.mean())
        results["staleness_max"] = float(staleness.max())
        results["staleness_checkpoint_every"] = 5
    print(json.dumps(results))


if __name__ == "__main__":
    main()
