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

    python benchmarks/graph_neighbors.py --only million [--nodes 20000] [--workers 2]
The graph-size side (issue 19): a synthetic SBM-like graph of 1,000,000 nodes (features and
neighbours computed from the node id, see ``million_features``), the bank sharded on ``--workers``
Dask workers with an embedding maker there encoding every node from the latest checkpoint. Last
line: JSON with step_1m_over_10k, the makers' refresh rate, the bank's bytes per node and the
staleness in checkpoint versions (``--nodes`` shrinks the large graph for a smoke test).

    python benchmarks/graph_neighbors.py --only gnn|gnn_k|gnn_size [--small] [--nodes N] [--workers 2]
                                         [--max-cpu-fraction 0.2]
The GNN of CARLS figure 3 (issue 28, ``carlskit.paradigms.gnn``): step time with K=100 neighbours
per node over K=10 when the neighbours' hidden embeddings come from the bank
(``gnn_t100_over_t10``) and when the step encodes the neighbours' features itself
(``gnn_inline_t100_over_t10``, the baseline), on Cora's shape; then ``gnn_step_1m_over_10k``: the
GNN's step time on the 1M-node graph over a 10k-node one, each timed while its embedding maker
keeps refreshing every node from the latest checkpoint (and, for reference, with the maker stopped).
The maker of both sizes runs with the same CPU budget (``Maker(max_cpu_fraction=)``, 0.2): unpaced,
its two slices took the trainer's two cores (step 2.9x slower at 1M). The sizes are timed in
interleaved windows (``benchmarks/_timing.py``), each lasting until every slice has refreshed all of
its nodes once; ``maker_rounds_per_window``, ``maker_nodes_per_s`` and ``maker_busy_fraction`` show
the refresh going on. ``gnn_k`` / ``gnn_size`` run one of the two parts.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from carlskit.bank import KnowledgeBank
from carlskit.makers import EmbeddingMaker, Maker
from carlskit.paradigms import gnn
from carlskit.paradigms.graph_reg import MLP, encode
from carlskit.training import CheckpointStore, NeighborKnowledge, Trainer, graph_regularization, masked_cross_entropy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import interleave, medians, ratio  # noqa: E402

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


MILLION_FEATURES, MILLION_BLOCKS, MILLION_K, CODEBOOK_ROWS = 128, 7, 10, 4096


def million_codebook() -> np.ndarray:
    """The only stored feature data of the synthetic graph: [CODEBOOK_ROWS + MILLION_BLOCKS, F] float32
    (2 MiB). Node i's features are a codebook row picked by a hash of i plus its block's mean."""
    return np.random.default_rng(19).normal(size=(CODEBOOK_ROWS + MILLION_BLOCKS, MILLION_FEATURES)).astype(np.float32)


def million_features(ids, codebook, xp=np):
    """Features of nodes ``ids`` computed on the fly (numpy or jax.numpy as ``xp``)."""
    ids = ids.astype(xp.uint32)
    row = (ids * xp.uint32(2654435761)) >> 20  # Knuth's multiplicative hash, 12 bits: [0, 4096)
    return codebook[row.astype(xp.int32)] + codebook[(CODEBOOK_ROWS + ids % MILLION_BLOCKS).astype(xp.int32)]


def million_encode(model, ids, codebook):
    """The maker's encoder: its 'features' are node ids; the features are computed on the fly."""
    return encode(model, million_features(ids, jnp.asarray(codebook), jnp))


def million_encode_hidden(model, ids, codebook):
    """The GNN maker's encoder (its node encoder's hidden layer), on features computed from the ids."""
    return gnn.encode_hidden(model, million_features(ids, jnp.asarray(codebook), jnp))


GNN_HIDDEN = 32


def million_variant(variant: str, codebook: np.ndarray, bank: KnowledgeBank) -> dict:
    """What differs between the graph-regularised MLP (issue 19) and the GNN (issue 28) on the large
    graph: the model, its loss, the bank table the maker fills and the trainer's knowledge stage."""
    if variant == "gnn":
        neighbors = NeighborKnowledge(bank, max_neighbors=MILLION_K, embeddings_table="hidden")
        return {"make_model": functools.partial(gnn.GNN, MILLION_FEATURES, GNN_HIDDEN, MILLION_BLOCKS, dropout=0.5,
                                                seed=0),
                "loss": gnn.bank_loss, "table": ("hidden", GNN_HIDDEN),
                "encode": functools.partial(million_encode_hidden, codebook=codebook),
                "knowledge": lambda batch: gnn.batch_positions(neighbors(batch))}
    return {"make_model": functools.partial(MLP, MILLION_FEATURES, 64, MILLION_BLOCKS, dropout=0.5, seed=0),
            "loss": bank_loss, "table": ("emb", MILLION_BLOCKS),
            "encode": functools.partial(million_encode, codebook=codebook),
            "knowledge": NeighborKnowledge(bank, max_neighbors=MILLION_K)}


def million_neighbors(ids: np.ndarray, num_nodes: int) -> np.ndarray:
    """SBM-like neighbours computed per node: [len(ids), MILLION_K], each in the node's block
    (id mod MILLION_BLOCKS) with probability 0.8, else uniform over all nodes."""
    ids = ids.astype(np.uint64)[:, None]
    slot = np.arange(MILLION_K, dtype=np.uint64)[None, :]
    h = (ids * np.uint64(0x9E3779B97F4A7C15) + slot * np.uint64(0xBF58476D1CE4E5B9)) >> np.uint64(16)
    h = h * np.uint64(0x94D049BB133111EB) >> np.uint64(8)
    same = (h % np.uint64(10)) < np.uint64(8)
    per_block = np.uint64(num_nodes // MILLION_BLOCKS)
    in_block = ids % np.uint64(MILLION_BLOCKS) + np.uint64(MILLION_BLOCKS) * ((h >> np.uint64(8)) % per_block)
    anywhere = (h >> np.uint64(8)) % np.uint64(num_nodes)
    return np.where(same, in_block, anywhere).astype(np.int64)


def million_data(num_nodes: int, batch_size: int, codebook: np.ndarray):
    rng = np.random.default_rng(0)

    def batch(step):
        ids = rng.integers(0, num_nodes, batch_size)
        return {"ids": ids, "features": million_features(ids, codebook), "labels": ids % MILLION_BLOCKS,
                "labelled": np.ones(batch_size, bool)}

    return batch


def million_run(num_nodes: int, client, num_shards: int, batch_size: int,
                live_steps: int, variant: str = "graph_reg", timed_steps: int = 0) -> tuple[KnowledgeBank, dict]:
    """One graph size: fill the sharded bank's neighbour records, let the maker encode every node
    (version 0), train ``live_steps`` with the maker live (staleness), time one refresh from a checkpoint's
    publication, read the maker's rate. Returns the filled bank (for timing) and the figures."""
    codebook = million_codebook()
    items = np.arange(num_nodes, dtype=np.int64)
    bank = KnowledgeBank(client=client, num_shards=num_shards)
    out: dict = {"nodes": num_nodes}
    table, dim = {"gnn": ("hidden", GNN_HIDDEN)}.get(variant, ("emb", MILLION_BLOCKS))
    bank.create_table(table, dim=dim, initializer="zeros")
    bank.create_feature_table("nbrs", schema={"ids": ("int64", MILLION_K), "weights": ("float32", MILLION_K)})
    start = time.perf_counter()
    for lo in range(0, num_nodes, 100_000):
        chunk = items[lo:lo + 100_000]
        bank.update("nbrs", chunk, {"ids": million_neighbors(chunk, num_nodes),
                                    "weights": np.full((len(chunk), MILLION_K), 1.0 / MILLION_K, np.float32)},
                    version=0)
    out["fill_neighbors_s"] = time.perf_counter() - start
    every = 5
    spec = million_variant(variant, codebook, bank)
    make_model = spec["make_model"]
    with tempfile.TemporaryDirectory() as directory:
        store = CheckpointStore(directory, keep=3)
        trainer = Trainer(make_model(), optax.adam(1e-3), spec["loss"], knowledge=spec["knowledge"],
                          checkpoints=store, checkpoint_every=every)
        trainer.save_checkpoint()
        maker = Maker(EmbeddingMaker(make_model, spec["encode"], items, batch_size=8192, table=table),
                      items, num_slices=num_shards, name="embeddings", poll_seconds=0.05)
        data = million_data(num_nodes, batch_size, codebook)
        start = time.perf_counter()
        maker.start(store, bank, client)
        try:
            maker.wait_for_version(0, timeout=1800)
            out["first_refresh_s"] = time.perf_counter() - start  # includes the workers' compile
            trainer.fit(data, live_steps, progress=False, live=False)
            if timed_steps:  # step time while the maker keeps refreshing every node
                out["step_with_maker_s"] = time_fit(trainer, data, timed_steps, 1)
            trainer.fit(data, 1, progress=False, live=False)
            start = time.perf_counter()
            trainer.save_checkpoint()
            maker.wait_for_version(trainer.step, timeout=1800)
            # publication to every node re-encoded; may include finishing the round in progress
            out["refresh_wall_s"] = time.perf_counter() - start
            slices = maker.status()["slices"]
        finally:
            maker.stop()
    rates = [s["items_per_s"] for s in slices if s["items_per_s"]]
    out["maker_items_per_s"] = float(sum(rates))  # slices run in parallel, one per worker
    out["maker_rounds"] = [s["rounds"] for s in slices]
    out["refresh_all_s"] = num_nodes / out["maker_items_per_s"]
    staleness = np.array([r["staleness"] for r in trainer.history if np.isfinite(r.get("staleness", np.nan))])
    out["staleness_steps_mean"] = float(staleness.mean())
    out["staleness_versions_mean"] = float(staleness.mean()) / every
    out["staleness_versions_max"] = float(staleness.max()) / every
    # the second half: past the first rounds, where staleness grows from 0 while the maker starts up
    out["staleness_versions_steady"] = float(staleness[len(staleness) // 2:].mean()) / every
    out["live_steps"] = live_steps
    out["checkpoint_every"] = every
    tables = bank.stats()["tables"]
    out["bank_bytes"] = {name: int(t["resident_bytes"]) for name, t in tables.items()}
    out["bank_bytes_per_node"] = sum(out["bank_bytes"].values()) / num_nodes
    print(f"{num_nodes} nodes: {json.dumps(out)}", file=sys.stderr, flush=True)
    return bank, out


def million_step_times(banks: dict[int, KnowledgeBank], batch_size: int, steps: int, warmup: int,
                       repeats: int, variant: str = "graph_reg") -> dict[int, list[float]]:
    """Trainer step time per graph size (maker stopped), sizes interleaved ``repeats`` times
    (``benchmarks/_timing.py``) so that load from other processes falls on both; the samples per size."""
    codebook = million_codebook()

    def timed(num_nodes: int, bank: KnowledgeBank):
        spec = million_variant(variant, codebook, bank)
        trainer = Trainer(spec["make_model"](), optax.adam(1e-3), spec["loss"], knowledge=spec["knowledge"])
        data = million_data(num_nodes, batch_size, codebook)

        def run() -> float:
            seconds = time_fit(trainer, data, steps, warmup)
            print(f"{num_nodes} nodes: {seconds * 1e3:.2f} ms/step", file=sys.stderr, flush=True)
            return seconds

        return run

    samples = interleave({str(n): timed(n, bank) for n, bank in banks.items()}, repeats, warmup=False)
    return {int(n): t for n, t in samples.items()}


def million_main(num_nodes: int, workers: int, small: bool) -> None:
    batch_size = 128
    steps, warmup, repeats, live_steps = (20, 5, 2, 40) if small else (100, 10, 3, 600)
    client = None
    if workers > 0:
        from carlskit.cluster import connect

        client = connect(n_workers=workers, memory_limit="2.5GiB")
    banks: dict[int, KnowledgeBank] = {}
    try:
        banks[10_000], small_run = million_run(10_000, client, max(1, workers), batch_size, live_steps)
        banks[num_nodes], large_run = million_run(num_nodes, client, max(1, workers), batch_size, live_steps)
        samples = million_step_times(banks, batch_size, steps, warmup, repeats)
        step = {n: float(np.median(t)) for n, t in samples.items()}
    finally:
        for bank in banks.values():
            bank.close()
        if client is not None:
            client.close()
    results = {
        "nodes": num_nodes, "workers": workers, "bank_shards": max(1, workers), "batch_size": batch_size,
        "k": MILLION_K, "feature_dim": MILLION_FEATURES, "feature_bytes_stored": int(million_codebook().nbytes),
        "step_10k_s": step[10_000], "step_1m_s": step[num_nodes], "step_1m_over_10k": step[num_nodes] / step[10_000],
        "maker_items_per_s": large_run["maker_items_per_s"], "maker_refresh_all_s": large_run["refresh_all_s"],
        "maker_refresh_wall_s": large_run["refresh_wall_s"], "maker_first_refresh_s": large_run["first_refresh_s"],
        "bank_bytes_per_node": large_run["bank_bytes_per_node"], "bank_bytes": large_run["bank_bytes"],
        "staleness_versions_mean": large_run["staleness_versions_mean"],
        "staleness_versions_max": large_run["staleness_versions_max"],
        "staleness_versions_steady": large_run["staleness_versions_steady"], "staleness_live_steps": live_steps,
        "staleness_checkpoint_every": large_run["checkpoint_every"],
        "runs": {"10k": small_run, "large": large_run},
    }
    print(json.dumps(results))


def gnn_inline_loss(model, batch):
    """The baseline: the step encodes every neighbour's features itself (gradient through them too)."""
    b, k, f = batch["neighbor_features"].shape
    neighbors = model.encode(batch["neighbor_features"].reshape(b * k, f), deterministic=False).reshape(b, k, -1)
    logits = model.classify(gnn.aggregate(model.encode(batch["features"], deterministic=False), neighbors,
                                          batch["neighbor_weights"]), deterministic=False)
    loss = masked_cross_entropy(logits, batch["labels"], batch["labelled"])
    return loss, {}


def gnn_neighbor_counts(small: bool) -> dict:
    """gnn_t100_over_t10 (bank-served) and gnn_inline_t100_over_t10 on Cora's shape, the four cases
    interleaved ``repeats`` times (``benchmarks/_timing.py``): medians of the per-repeat ratios and
    their spreads."""
    batch_size, ks = (32 if small else 128), (10, 100)  # small: the notebook's smoke run (inline K=100 is slow)
    # the inline K=100 step is ~100x the others (2.4 s at batch 128 on 2 cores): fewer steps per sample
    steps, inline_steps, repeats = (4, 2, 2) if small else (30, 3, 5)
    rng = np.random.default_rng(0)
    features = (rng.random((NUM_ITEMS, NUM_FEATURES)) < 0.01).astype(np.float32)
    labels = rng.integers(0, NUM_CLASSES, NUM_ITEMS)
    neighbors = rng.integers(0, NUM_ITEMS, (NUM_ITEMS, max(ks)))
    make_model = functools.partial(gnn.GNN, NUM_FEATURES, HIDDEN, NUM_CLASSES, dropout=0.5, seed=0)
    bank = KnowledgeBank()
    bank.create_table("hidden", dim=HIDDEN, initializer="zeros")
    bank.create_feature_table("nbrs", schema={"ids": ("int64", max(ks)), "weights": ("float32", max(ks))})
    items = np.arange(NUM_ITEMS)
    bank.update("nbrs", items, {"ids": neighbors, "weights": np.ones_like(neighbors, np.float32)}, version=0)
    bank.update("hidden", items, np.asarray(gnn.encode_hidden(make_model(), jnp.asarray(features))), version=0)

    def case(mode: str, k: int):
        if mode == "bank":
            knowledge = NeighborKnowledge(bank, max_neighbors=k, embeddings_table="hidden")
            trainer = Trainer(make_model(), optax.adam(1e-3), gnn.bank_loss,
                              knowledge=lambda batch: gnn.batch_positions(knowledge(batch)))
        else:
            trainer = Trainer(make_model(), optax.adam(1e-3), gnn_inline_loss)
        data = make_data(k, batch_size, features, labels, neighbors, mode == "inline")
        trainer.fit(data, 2, progress=False, live=False)  # compile

        def run() -> float:
            seconds = time_fit(trainer, data, inline_steps if mode == "inline" else steps, 1)
            print(f"GNN K={k:4d}  {mode:6s} {seconds * 1e3:8.2f} ms/step", file=sys.stderr, flush=True)
            return seconds

        return run

    samples = interleave({f"{mode}{k}": case(mode, k) for mode in ("bank", "inline") for k in ks}, repeats,
                         warmup=False)
    step = medians(samples)
    return {"gnn_batch_size": batch_size, "gnn_repeats": repeats,
            "gnn_bank_step_s": {k: step[f"bank{k}"] for k in ks},
            "gnn_inline_step_s": {k: step[f"inline{k}"] for k in ks},
            **ratio(samples, "bank100", "bank10", "gnn_t100_over_t10"),
            **ratio(samples, "inline100", "inline10", "gnn_inline_t100_over_t10")}


class LiveGraph:
    """One graph size for the GNN's step-time-with-maker comparison: a sharded bank holding the
    graph's neighbour records and hidden embeddings, a trainer publishing checkpoints every 5 steps,
    and an embedding maker paced to ``max_cpu_fraction`` re-encoding every node from the latest one."""

    def __init__(self, num_nodes: int, client, num_shards: int, batch_size: int, max_cpu_fraction: float):
        self.num_nodes, self.client = num_nodes, client
        codebook = million_codebook()
        self.items = np.arange(num_nodes, dtype=np.int64)
        self.bank = KnowledgeBank(client=client, num_shards=num_shards)
        self.bank.create_table("hidden", dim=GNN_HIDDEN, initializer="zeros")
        self.bank.create_feature_table("nbrs", schema={"ids": ("int64", MILLION_K), "weights": ("float32", MILLION_K)})
        for lo in range(0, num_nodes, 100_000):
            chunk = self.items[lo:lo + 100_000]
            self.bank.update("nbrs", chunk, {"ids": million_neighbors(chunk, num_nodes),
                                             "weights": np.full((len(chunk), MILLION_K), 1.0 / MILLION_K, np.float32)},
                             version=0)
        spec = million_variant("gnn", codebook, self.bank)
        self.directory = tempfile.mkdtemp()
        self.store = CheckpointStore(self.directory, keep=3)
        self.trainer = Trainer(spec["make_model"](), optax.adam(1e-3), spec["loss"], knowledge=spec["knowledge"],
                               checkpoints=self.store, checkpoint_every=5)
        self.trainer.save_checkpoint()
        self.maker = Maker(EmbeddingMaker(spec["make_model"], spec["encode"], self.items, batch_size=8192,
                                          table="hidden"),
                           self.items, num_slices=num_shards, name=f"embeddings-{num_nodes}", poll_seconds=0.05,
                           max_cpu_fraction=max_cpu_fraction)
        self.data = million_data(num_nodes, batch_size, codebook)
        self.windows: list[dict] = []
        start = time.perf_counter()
        self.maker.start(self.store, self.bank, client)
        self.maker.wait_for_version(0, timeout=1800)
        self.first_refresh_s = time.perf_counter() - start  # the workers' compile and one paced round
        self.trainer.fit(self.data, 5, progress=False, live=False)  # the trainer's compile

    def rounds(self) -> list[int]:
        return [s["rounds"] for s in self.maker.status()["slices"]]

    def window(self, min_steps: int) -> float:
        """Seconds per step while the maker refreshes, over at least ``min_steps`` and until every
        slice has completed a round begun in the window (the maker is idle when it starts: a full
        refresh of every node happens inside it); then wait (unmeasured) until the maker has caught
        up with the last checkpoint, so its work never spills into the next window of another size.
        Records the rounds each slice completed during the window."""
        before, start, steps = self.rounds(), time.perf_counter(), 0
        while steps < min_steps or min(b - a for a, b in zip(before, self.rounds())) < 1:
            self.trainer.fit(self.data, 25, progress=False, live=False)
            steps += 25
        seconds = time.perf_counter() - start
        completed = [b - a for a, b in zip(before, self.rounds())]
        self.trainer.save_checkpoint()
        self.maker.wait_for_version(self.trainer.step, timeout=1800)
        self.windows.append({"seconds": seconds, "steps": steps, "rounds_completed": completed})
        print(f"{self.num_nodes} nodes: {seconds / steps * 1e3:.2f} ms/step with the maker refreshing "
              f"(rounds completed per slice {completed})", file=sys.stderr, flush=True)
        return seconds / steps

    def figures(self) -> dict:
        slices = self.maker.status()["slices"]
        staleness = np.array([r["staleness"] for r in self.trainer.history
                              if np.isfinite(r.get("staleness", np.nan))])
        rate = float(sum(s["items_per_s"] for s in slices))  # slices run in parallel, one per worker
        return {"nodes": self.num_nodes, "first_refresh_s": self.first_refresh_s,
                "maker_nodes_per_s": rate, "maker_refresh_all_s": self.num_nodes / rate,
                "maker_busy_fraction": [round(s["busy_fraction"], 3) for s in slices],
                "maker_rounds_total": [s["rounds"] for s in slices],
                "window_rounds_completed": [w["rounds_completed"] for w in self.windows],
                "window_seconds": [round(w["seconds"], 2) for w in self.windows],
                "staleness_versions_mean": float(staleness.mean()) / 5,
                "staleness_versions_max": float(staleness.max()) / 5}

    def close(self) -> None:
        self.maker.stop()
        self.bank.close()
        shutil.rmtree(self.directory, ignore_errors=True)


def gnn_main(num_nodes: int, workers: int, small: bool, max_cpu_fraction: float, part: str = "gnn") -> None:
    results = {"load_before": os.getloadavg()[0]}
    if part in ("gnn", "gnn_k"):
        results.update(gnn_neighbor_counts(small))
    if part == "gnn_k":
        print(json.dumps(results))
        return
    batch_size = 128
    window_steps, repeats = (50, 1) if small else (200, 3)
    client = None
    if workers > 0:
        from carlskit.cluster import connect

        client = connect(n_workers=workers, memory_limit="2.5GiB")
    graphs: dict[int, LiveGraph] = {}
    try:
        for size in (10_000, num_nodes):
            graphs[size] = LiveGraph(size, client, max(1, workers), batch_size, max_cpu_fraction)
        samples = interleave({str(n): functools.partial(graph.window, window_steps) for n, graph in graphs.items()},
                             repeats, warmup=False)
        live = {n: graph.figures() for n, graph in graphs.items()}
        for graph in graphs.values():
            graph.maker.stop()
        stopped = million_step_times({n: graph.bank for n, graph in graphs.items()}, batch_size,
                                     20 if small else 50, 5, repeats, "gnn")
    finally:
        for graph in graphs.values():
            graph.close()
        if client is not None:
            client.close()
    step = medians(samples)
    large = live[num_nodes]
    results.update({
        "nodes": num_nodes, "workers": workers, "k": MILLION_K, "hidden": GNN_HIDDEN, "window_steps": window_steps,
        "repeats": repeats, "max_cpu_fraction": max_cpu_fraction,
        "gnn_step_10k_s": step["10000"], "gnn_step_1m_s": step[str(num_nodes)],
        **ratio(samples, str(num_nodes), "10000", "gnn_step_1m_over_10k"),
        **ratio({str(n): t for n, t in stopped.items()}, str(num_nodes), "10000", "gnn_step_1m_over_10k_maker_stopped"),
        "maker_nodes_per_s": large["maker_nodes_per_s"], "maker_refresh_all_s": large["maker_refresh_all_s"],
        "maker_rounds_per_window": large["window_rounds_completed"],
        "maker_busy_fraction": large["maker_busy_fraction"],
        "staleness_versions_mean": large["staleness_versions_mean"],
        "staleness_versions_max": large["staleness_versions_max"], "load_after": os.getloadavg()[0],
        "runs": {"10k": live[10_000], "large": large},
    })
    print(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--only", choices=["million", "gnn", "gnn_k", "gnn_size"], default=None,
                        help="run only this part (default: the neighbour-count part; gnn is gnn_k then gnn_size)")
    parser.add_argument("--nodes", type=int, default=1_000_000, help="--only million/gnn: the large graph's nodes")
    parser.add_argument("--workers", type=int, default=2,
                        help="--only million/gnn: Dask workers (0: in-process bank)")
    parser.add_argument("--max-cpu-fraction", type=float, default=0.2,
                        help="--only gnn: each maker slice's CPU budget (Maker's max_cpu_fraction), both graph sizes")
    args = parser.parse_args()
    if args.only == "million":
        return million_main(args.nodes, args.workers, args.small)
    if args.only in ("gnn", "gnn_k", "gnn_size"):
        return gnn_main(args.nodes, args.workers, args.small or os.environ.get("CARLSKIT_SMALL") == "1",
                        args.max_cpu_fraction, args.only)
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
