"""Node embeddings learned through the knowledge bank: DeepWalk random walks and skip-gram with negative sampling.

DeepWalk (Perozzi et al. 2014; node2vec with p = q = 1): ``walks_per_node`` uniform random walks
of ``walk_length`` nodes start at every node; every pair (centre, context) at most ``window`` steps
apart in a walk is a positive (the nearer, the likelier: offset o is kept with probability
(window - o + 1) / window, word2vec's shrunk window); each positive gets ``negatives`` contexts drawn
from the unigram distribution of the walks to the power 3/4. The skip-gram loss per pair is

    -log sigmoid(<u_centre, c_context>) - sum_k log sigmoid(-<u_centre, c_negative_k>)

and both tables, the node embeddings u ("nodes") and the context embeddings c ("contexts"), live in
the knowledge bank: the trainer's input pipeline looks up the rows of each batch's distinct ids and
the bank's Adagrad (``optimizer="sgd"``: plain SGD) applies their gradients
(``carlskit.training.BankEmbeddings``). The model itself has no dense parameters. A logistic
regression (scikit-learn) on the L2-normalised node embeddings of the Planetoid training nodes is
evaluated on the validation and test nodes, as in the Planetoid
paper's DeepWalk row (Yang et al. 2016, table 2: Cora 67.2, Citeseer 43.2).

Learning rate and pairs per node: the context rows start at zero and the node rows near it
(+-0.5/dim), so the gradient of each is proportional to the other and a (node, context) pair of rows
grows by about (1 + lr / sqrt(initial_accumulator_value) / 2) per use before anything is learned.
Cora's default run gives each node about 2,400 pairs an epoch and learns at the default 0.05; one
walk of 10 per node (about 46 pairs, the million-node run) stays at chance at 0.05 and learns at
0.2 (``tests/paradigms/test_node_embeddings.py``; figures in BENCHMARKS.md).

Several trainers (``--trainers N`` with ``--workers >= N``): each trains on the walks that start at
its share of the nodes, on its own Dask worker, and all share the two tables in the bank, whose
lazy update (``max_pending > 1``) combines their gradients: averaged (``combine="mean"``, CARLS;
the loss is a sum over pairs, so averaging shrinks a row's step by the number of gradients its next
lookup finds cached, which depends on the trainers' timing: tune its rate) or summed
(``combine="sum"``, the same rows as immediate SGD). Two trainers on Cora:
``benchmarks/lazy_vs_immediate.py``.

Command line (prints one JSON object as its last line)::

    python -m carlskit.paradigms.node_embeddings [--data cora|citeseer|FILE.npz] [--seed S]
        [--epochs E] [--workers N --trainers T] [--synthetic-nodes N] [--walks-per-node W]
        [--walk-length L] [--steps S] [--dim D] [--initial-accumulator-value A] [--learning-rate R]
"""

from __future__ import annotations

if __name__ == "__main__":  # answer --help and usage errors before JAX is imported
    from carlskit.paradigms._cli import parse_arguments

    parse_arguments("node_embeddings")

import threading
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from carlskit.bank import KnowledgeBank
from carlskit.cluster import live_workers
from carlskit.data import Dataset, load_planetoid, synthetic_planetoid
from carlskit.paradigms._cli import parse_arguments, run_and_print, say
from carlskit.training import BankEmbedding, BankEmbeddings, Trainer

#: Planetoid paper (Yang, Cohen & Salakhutdinov 2016), table 2, DeepWalk: test accuracy (%)
PUBLISHED_DEEPWALK = {"cora": 67.2, "citeseer": 43.2}


@dataclass(frozen=True)
class NodeEmbeddingConfig:
    """Hyperparameters (DeepWalk's walks and window; the rest chosen on Cora's validation split)."""

    dim: int = 128
    walks_per_node: int = 10
    walk_length: int = 40
    window: int = 5
    negatives: int = 5
    batch_size: int = 4096
    epochs: float = 1.0
    optimizer: str = "adagrad"  # the bank tables' optimizer: "adagrad" or "sgd"
    learning_rate: float = 0.05  # the bank tables' optimizer's
    initial_accumulator_value: float = 0.1  # Adagrad's
    max_pending: int = 1  # 1: a gradient is applied when it arrives; more: cached until the next lookup
    combine: str = "mean"  # with max_pending > 1: a row's cached gradients averaged (CARLS) or summed
    max_staleness: int = 1


class SkipGram(nnx.Module):
    """The skip-gram model: both embedding tables in the bank, no dense parameters."""

    def __init__(self, dim: int):
        self.nodes = BankEmbedding("nodes", dim)
        self.contexts = BankEmbedding("contexts", dim)

    def __call__(self, batch: dict) -> tuple[jax.Array, jax.Array]:
        """Scores of the positive [B] and negative [B, K] pairs."""
        centre = self.nodes(batch, "centre")
        positive = jnp.sum(centre * self.contexts(batch, "context"), axis=-1)
        negative = jnp.einsum("bd,bkd->bk", centre, self.contexts(batch, "negatives"))
        return positive, negative


def skip_gram_loss(model: SkipGram, batch: dict) -> tuple[jax.Array, dict]:
    """The sum over the batch's pairs of -log s(u.c) - sum_k log s(-u.n_k): each pair pulls on its
    rows as in word2vec's per-pair SGD, whatever the batch size (a mean would shrink a row's
    gradient by the batch size). The metric ``pair_loss`` is the mean per pair."""
    positive, negative = model(batch)
    per_pair = -jax.nn.log_sigmoid(positive) - jnp.sum(jax.nn.log_sigmoid(-negative), axis=-1)
    return jnp.sum(per_pair), {"pair_loss": jnp.mean(per_pair)}


def adjacency(edges: np.ndarray, num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """CSR (indptr [n + 1], neighbours) of the undirected graph ``edges`` [M, 2]."""
    both = np.concatenate([edges, edges[:, ::-1]]) if len(edges) else np.zeros((0, 2), np.int64)
    order = np.argsort(both[:, 0], kind="stable")
    indptr = np.zeros(num_nodes + 1, np.int64)
    np.cumsum(np.bincount(both[:, 0], minlength=num_nodes), out=indptr[1:])
    return indptr, both[order, 1].astype(np.int64)


def random_walks(indptr: np.ndarray, neighbors: np.ndarray, starts: np.ndarray, length: int,
                 rng: np.random.Generator) -> np.ndarray:
    """Uniform random walks [len(starts), length] (a node without neighbours stays where it is)."""
    walks = np.empty((len(starts), length), np.int64)
    walks[:, 0] = current = starts
    degree = np.diff(indptr)
    for step in range(1, length):
        d = degree[current]
        pick = indptr[current] + (rng.random(len(current)) * np.maximum(d, 1)).astype(np.int64)
        current = np.where(d > 0, neighbors[np.minimum(pick, len(neighbors) - 1)], current)
        walks[:, step] = current
    return walks


def skip_gram_pairs(walks: np.ndarray, window: int, rng: np.random.Generator) -> np.ndarray:
    """(centre, context) pairs [P, 2], both directions, offset o kept with probability
    (window - o + 1) / window, shuffled."""
    pairs = []
    for offset in range(1, window + 1):
        keep = rng.random(walks[:, offset:].shape) < (window - offset + 1) / window
        a, b = walks[:, :-offset][keep], walks[:, offset:][keep]
        pairs += [np.stack([a, b], 1), np.stack([b, a], 1)]
    pairs = np.concatenate(pairs)
    return pairs[rng.permutation(len(pairs))]


class SkipGramBatches:
    """``f(step) -> batch`` of one trainer: its share of the walks (those starting at nodes ``node %
    num_shards == shard``), built on first use (so it travels to a Dask worker as the graph only),
    cycled over in shuffled order; negatives from the unigram^0.75 distribution of all walks."""

    def __init__(self, edges: np.ndarray, num_nodes: int, config: NodeEmbeddingConfig, *, seed: int,
                 shard: int = 0, num_shards: int = 1):
        self.edges, self.num_nodes, self.config = edges, num_nodes, config
        self.seed, self.shard, self.num_shards = seed, shard, num_shards
        self._pairs = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_pairs", "_lock")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _pairs=None, _lock=threading.Lock())

    def _build(self) -> None:
        c = self.config
        rng = np.random.default_rng([self.seed, self.shard])
        indptr, neighbors = adjacency(self.edges, self.num_nodes)
        mine = np.arange(self.shard, self.num_nodes, self.num_shards)
        walks = random_walks(indptr, neighbors, np.tile(mine, c.walks_per_node), c.walk_length, rng)
        self._pairs = skip_gram_pairs(walks, c.window, rng)
        counts = np.bincount(walks.ravel(), minlength=self.num_nodes).astype(np.float64) ** 0.75
        self._cumulative = np.cumsum(counts / counts.sum())
        self._rng = rng

    @property
    def num_pairs(self) -> int:
        with self._lock:
            if self._pairs is None:
                self._build()
        return len(self._pairs)

    def steps_per_epoch(self) -> int:
        return max(1, self.num_pairs // self.config.batch_size)

    def __call__(self, step: int) -> dict:
        with self._lock:
            if self._pairs is None:
                self._build()
        b = self.config.batch_size
        start = (step * b) % max(1, len(self._pairs) - b + 1)
        pairs = self._pairs[start:start + b]
        negatives = np.searchsorted(self._cumulative, self._rng.random((len(pairs), self.config.negatives)))
        return {"centre": pairs[:, 0], "context": pairs[:, 1],
                "negatives": np.minimum(negatives, self.num_nodes - 1).astype(np.int64)}


def create_tables(bank: KnowledgeBank, config: NodeEmbeddingConfig, num_nodes: int, seed: int) -> None:
    """The node table (word2vec's init: U(-0.5/dim, 0.5/dim)) and the context table (zeros), on the
    config's optimizer (Adagrad by default)."""
    options = dict(optimizer=config.optimizer, learning_rate=config.learning_rate,
                   initial_accumulator_value=config.initial_accumulator_value, max_pending=config.max_pending,
                   combine=config.combine, capacity=num_nodes)
    bank.create_table("nodes", config.dim, initializer="uniform", init_scale=0.5 / config.dim, seed=seed, **options)
    bank.create_table("contexts", config.dim, initializer="zeros", **options)


def make_trainer(bank: KnowledgeBank, config: NodeEmbeddingConfig, num_nodes: int) -> Trainer:
    """A trainer whose only parameters are the bank's ``nodes`` and ``contexts`` tables (skip-gram
    with negative sampling): rows looked up ahead of each step, gradients pushed back to the bank."""
    stage = BankEmbeddings(bank, {"nodes": ["centre"], "contexts": ["context", "negatives"]},
                           num_ids={"nodes": num_nodes, "contexts": num_nodes}, max_staleness=config.max_staleness)
    # no dense parameters: the optax optimizer has nothing to update
    return Trainer(SkipGram(config.dim), optax.sgd(0.0), skip_gram_loss, knowledge=stage)


def node_embeddings(bank: KnowledgeBank, num_nodes: int) -> np.ndarray:
    """The learned node table [num_nodes, dim] (flushing cached gradients first)."""
    bank.flush("nodes")
    values, _ = bank.lookup("nodes", np.arange(num_nodes))
    return values


def evaluate(embeddings: np.ndarray, data: Dataset, seed: int = 0) -> dict:
    """Logistic regression (scikit-learn, C chosen on the validation split) on L2-normalised
    embeddings of the training nodes; accuracy on the validation and test nodes."""
    from sklearn.linear_model import LogisticRegression

    x = embeddings / np.maximum(np.linalg.norm(embeddings, axis=1, keepdims=True), 1e-12)
    best = None
    for c in (0.1, 1.0, 10.0, 100.0):
        model = LogisticRegression(C=c, max_iter=2000, random_state=seed).fit(x[data.train_idx],
                                                                               data.labels[data.train_idx])
        val = float(model.score(x[data.val_idx], data.labels[data.val_idx])) if len(data.val_idx) else 0.0
        if best is None or val > best[0]:
            best = (val, c, model)
    val, c, model = best
    return {"val_acc": val, "test_acc": float(model.score(x[data.test_idx], data.labels[data.test_idx])),
            "logistic_c": c}


def train(data: Dataset, config: NodeEmbeddingConfig, *, seed: int = 0, client: Any = None, num_shards: int = 1,
          trainers: int = 1, steps: int | None = None, progress: bool | str = False) -> dict:
    """Learn node embeddings with ``trainers`` trainers sharing the bank tables, then evaluate them.

    One trainer trains in this process; several each on their own Dask worker of ``client`` (the
    i-th trainer on the i-th worker). ``steps`` per trainer defaults to ``epochs`` passes over its
    pairs. Returns the accuracies, the loss history of each trainer, steps, samples and seconds."""
    if data.edges is None:
        raise ValueError(f"node embeddings need a graph; {data.name} has no edges")
    if trainers > 1 and client is None:
        raise ValueError(f"trainers={trainers} run on Dask workers: pass a client")
    started = time.perf_counter()
    bank = KnowledgeBank(client=client, num_shards=num_shards)
    try:
        create_tables(bank, config, data.num_items, seed)
        sources = [SkipGramBatches(data.edges, data.num_items, config, seed=seed, shard=i, num_shards=trainers)
                   for i in range(trainers)]
        steps = steps or max(1, int(config.epochs * sources[0].steps_per_epoch()))
        runs = [make_trainer(bank, config, data.num_items) for _ in range(trainers)]
        if trainers == 1:
            runs[0].fit(sources[0], steps, progress=progress, live=False)
        else:
            workers = sorted(live_workers(client))
            if len(workers) < trainers:
                raise ValueError(f"{trainers} trainers need {trainers} Dask workers, the cluster has {len(workers)}")
            handles = [run.fit(source, steps, client=client, workers=[worker], block=False,
                               progress=progress and f"{progress} trainer {i}", live=False)
                       for i, (run, source, worker) in enumerate(zip(runs, sources, workers))]
            for handle in handles:
                handle.wait()
        train_seconds = time.perf_counter() - started
        result = evaluate(node_embeddings(bank, data.num_items), data, seed)
        stats = bank.stats()["tables"]
    finally:
        bank.close()
    return {**result, "steps": steps, "trainers": trainers, "samples": steps * config.batch_size * trainers,
            "train_seconds": train_seconds, "seconds": time.perf_counter() - started,
            "losses": [[r["pair_loss"] for r in run.history] for run in runs],
            "rows": {t: stats[t]["rows"] for t in ("nodes", "contexts")},
            "optimizer_steps": stats["nodes"]["optimizer_steps"] + stats["contexts"]["optimizer_steps"]}


def main(argv: list[str] | None = None) -> dict:
    """The command line (``python -m carlskit.paradigms.node_embeddings --help``): learns node
    embeddings on a graph and prints one JSON line with the logistic regression's accuracies."""
    args = parse_arguments("node_embeddings", argv)
    if args.synthetic_nodes:  # node features are not used: one word per node keeps the graph small
        data = synthetic_planetoid(num_nodes=args.synthetic_nodes, num_classes=6, homophily=0.8, mean_degree=8.0,
                                   num_features=12, words_per_node=1, seed=args.seed)
    else:
        data = load_planetoid(args.data)
    say(f"node_embeddings: {data}", args.quiet)
    config = NodeEmbeddingConfig()
    options = {"epochs": args.epochs, "walks_per_node": args.walks_per_node, "walk_length": args.walk_length,
               "dim": args.dim, "initial_accumulator_value": args.initial_accumulator_value,
               "learning_rate": args.learning_rate}
    config = replace(config, **{k: v for k, v in options.items() if v is not None})
    if args.trainers > 1 and args.workers < args.trainers:
        raise SystemExit(f"--trainers {args.trainers} needs --workers >= {args.trainers}")

    def run(client, num_shards):
        result = train(data, config, seed=args.seed, client=client, num_shards=num_shards, trainers=args.trainers,
                       steps=args.steps, progress=not args.quiet and data.name)
        published = PUBLISHED_DEEPWALK.get(data.name.lower())
        return {"data": data.name, "test_acc": result["test_acc"], "val_acc": result["val_acc"],
                "published_deepwalk_test_acc": published, "seed": args.seed, "trainers": args.trainers,
                "steps": result["steps"], "samples": result["samples"], "seconds": result["seconds"],
                "train_seconds": result["train_seconds"], "nodes": data.num_items, "rows": result["rows"],
                "final_pair_loss": float(np.mean([np.mean(loss[-20:]) for loss in result["losses"]])),
                "final_pair_loss_per_trainer": [float(np.mean(loss[-20:])) for loss in result["losses"]],
                "config": asdict(config)}

    return run_and_print(args.workers, run, quiet=args.quiet)


if __name__ == "__main__":
    main()
