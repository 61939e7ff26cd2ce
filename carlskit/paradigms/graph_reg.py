"""Graph-regularized semi-supervised learning with CARLS (paper section 4.1, figure 2).

loss = cross-entropy on labelled items
       + multiplier * mean_i sum_k w_ik * distance(embedding(x_i), bank_embedding(neighbour_ik))

where the neighbours' embeddings are *read from the knowledge bank*, computed there by an embedding
maker from the trainer's latest checkpoint, so the trainer never encodes a neighbour; neighbour
weights are normalised to sum to 1 per item. The embedding is the model's class distribution
(softmax) from a dropout-free forward pass. The graph comes from the data set (Planetoid edges) or
is itself learned: a neighbour maker rebuilds each item's k nearest neighbours in the hidden-layer
embedding space after every checkpoint.

Command line (prints one JSON object as its last line)::

    python -m carlskit.paradigms.graph_reg [--data cora] [--neighbors K] [--seed S] [--workers N]
    python -m carlskit.paradigms.graph_reg --data digits [--label-fraction 0.05]
"""

from __future__ import annotations

if __name__ == "__main__":  # answer --help and usage errors before JAX is imported (~0.3 s, not ~15 s)
    from carlskit.paradigms._cli import parse_arguments

    parse_arguments("graph_reg")

import functools
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from carlskit.bank import KnowledgeBank
from carlskit.data import Dataset, load_digits, load_planetoid, neighbors_from_edges
from carlskit.makers import EmbeddingMaker, Maker, NeighborMaker
from carlskit.paradigms._cli import makers_running, parse_arguments, run_and_print, say
from carlskit.training import (
    CheckpointStore,
    NeighborKnowledge,
    Trainer,
    check_embedding_dim,
    graph_regularization,
    masked_cross_entropy,
)


class MLP(nnx.Module):
    """Two-layer perceptron with dropout; ``embed`` gives the hidden layer and class distribution."""

    def __init__(self, num_features: int, hidden: int, num_classes: int, *, dropout: float, seed: int):
        rngs = nnx.Rngs(params=seed, dropout=seed + 1)
        self.hidden = nnx.Linear(num_features, hidden, rngs=rngs)
        self.output = nnx.Linear(hidden, num_classes, rngs=rngs)
        self.input_dropout = nnx.Dropout(dropout, rngs=rngs)
        self.hidden_dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x: jax.Array, *, deterministic: bool = False) -> jax.Array:
        h = nnx.relu(self.hidden(self.input_dropout(x, deterministic=deterministic)))
        return self.output(self.hidden_dropout(h, deterministic=deterministic))

    def embed(self, x: jax.Array) -> dict[str, jax.Array]:
        h = nnx.relu(self.hidden(x))
        return {"emb": jax.nn.softmax(self.output(h)), "hidden": h}


def encode(model: MLP, features: jax.Array, tables: tuple[str, ...] = ("emb",)) -> dict[str, jax.Array]:
    """The embedding maker's encoder: the bank tables it fills, from a dropout-free pass."""
    embeddings = model.embed(features)
    return {table: embeddings[table] for table in tables}


@dataclass(frozen=True)
class GraphRegConfig:
    """Hyperparameters (chosen on Cora's validation split only)."""

    neighbors: int = 32
    multiplier: float = 5.0
    distance: str = "l2"
    hidden: int = 64
    dropout: float = 0.5
    learning_rate: float = 0.01
    weight_decay: float = 5e-4
    steps: int = 300
    batch_size: int = 1024
    warmup_steps: int = 50
    checkpoint_every: int = 10
    learned_graph: bool = False  # True: neighbour maker builds the graph (no edges needed)


# Chosen on digits' validation split (5% labels): a learned 5-nearest-neighbour graph, lighter dropout.
DIGITS_CONFIG = GraphRegConfig(learned_graph=True, neighbors=5, dropout=0.2, hidden=256)


def loss_fn(model: MLP, batch: dict, *, distance: str) -> tuple[jax.Array, dict]:
    """Cross-entropy on the batch's labelled items plus, with neighbour knowledge, the graph term:
    ``multiplier`` times the weighted ``distance`` between each item's embedding and its neighbours' bank
    embeddings; returns the loss and its parts (``supervised``, ``graph``)."""
    logits = model(batch["features"])
    supervised = masked_cross_entropy(logits, batch["labels"], batch["labelled"])
    if "neighbor_embeddings" not in batch:
        return supervised, {"supervised": supervised}
    samples = model.embed(batch["features"])["emb"]
    weights = batch["neighbor_weights"]
    weights = weights / jnp.maximum(weights.sum(axis=1, keepdims=True), 1e-6)
    regularizer = graph_regularization(samples, batch["neighbor_embeddings"], weights, distance)
    return supervised + batch["multiplier"] * regularizer, {"supervised": supervised, "graph": regularizer}


def batches(data: Dataset, features: np.ndarray, config: GraphRegConfig, seed: int, multiplier: float):
    """f(step) -> batch: every labelled item plus ``batch_size`` items drawn from all items."""
    rng = np.random.default_rng(seed)
    labelled = np.zeros(data.num_items, bool)
    labelled[data.train_idx] = True

    def batch(step: int) -> dict:
        ids = np.concatenate([data.train_idx, rng.choice(data.num_items, config.batch_size, replace=False)
                              if config.batch_size < data.num_items else np.arange(data.num_items)])
        ramp = min(1.0, max(0.0, (step - config.warmup_steps) / max(config.warmup_steps, 1)))
        return {"ids": ids, "features": features[ids], "labels": np.maximum(data.labels[ids], 0),
                "labelled": labelled[ids], "multiplier": np.float32(multiplier * ramp)}

    return batch


def accuracy(model: MLP, features: np.ndarray, labels: np.ndarray, index: np.ndarray) -> float:
    """The fraction of items ``index`` the model (dropout off) labels correctly."""
    predictions = np.asarray(jnp.argmax(model(jnp.asarray(features[index]), deterministic=True), axis=-1))
    return float(np.mean(predictions == labels[index]))


def _features(data: Dataset) -> np.ndarray:
    if data.edges is not None:  # bag-of-words graphs: row-normalise, as is standard for Planetoid
        return data.features / np.maximum(data.features.sum(axis=1, keepdims=True), 1.0)
    return data.features


def train(data: Dataset, config: GraphRegConfig, *, regularize: bool, seed: int = 0, client: Any = None,
          num_shards: int = 1, workdir: str | None = None, progress: bool | str = False) -> dict:
    """Train one MLP; with ``regularize`` the bank, an embedding maker (and a neighbour maker for a
    learned graph) run beside the trainer. The checkpoint (one every ``checkpoint_every`` steps) most
    accurate on the validation split is the result (``selected_step``, ``val_acc``; the last step wins
    ties). Returns accuracies, steps, seconds and statistics."""
    features = _features(data)
    make_model = functools.partial(MLP, data.num_features, config.hidden, data.num_classes,
                                   dropout=config.dropout, seed=seed)
    model = make_model()
    optimizer = optax.adamw(config.learning_rate, weight_decay=config.weight_decay)
    started = time.perf_counter()
    loss = functools.partial(loss_fn, distance=config.distance)
    with tempfile.TemporaryDirectory(prefix="carlskit-graph-reg-") as scratch:
        store = CheckpointStore(f"{workdir or scratch}/checkpoints", keep=None)  # all kept: selected at the end
        if not regularize:
            trainer = Trainer(model, optimizer, loss, checkpoints=store, checkpoint_every=config.checkpoint_every)
            trainer.fit(batches(data, features, config, seed, 0.0), config.steps, progress=progress, live=False)
            return _result(trainer, data, features, started, {}, make_model)
        bank = KnowledgeBank(client=client, num_shards=num_shards)
        try:
            return _train_with_bank(data, config, model, optimizer, loss, make_model, features, bank,
                                    client, num_shards, store, progress, started, seed)
        finally:
            bank.close()


def _train_with_bank(data, config, model, optimizer, loss, make_model, features, bank, client,
                     num_shards, store, progress, started, seed) -> dict:
    width = config.neighbors
    bank.create_table("emb", dim=data.num_classes, initializer="zeros")
    bank.create_feature_table("nbrs", schema={"ids": ("int64", width), "weights": ("float32", width)})
    check_embedding_dim(bank, "emb", int(encode(model, jnp.asarray(features[:1]))["emb"].shape[-1]))
    items = np.arange(data.num_items, dtype=np.int64)
    makers = []
    slices = max(1, num_shards)
    if config.learned_graph:
        bank.create_table("hidden", dim=config.hidden, initializer="zeros")
        makers.append(Maker(NeighborMaker(config.neighbors, table="hidden", metric="cosine"), items,
                            num_slices=slices, name="neighbors"))
    else:
        ids, weights = neighbors_from_edges(data.edges, data.num_items, width, seed=seed)
        bank.update("nbrs", items, {"ids": ids, "weights": weights}, version=0)
    tables = ("emb", "hidden") if config.learned_graph else ("emb",)
    makers.insert(0, Maker(EmbeddingMaker(make_model, functools.partial(encode, tables=tables), features), items,
                           num_slices=slices, name="embeddings"))
    trainer = Trainer(model, optimizer, loss, knowledge=NeighborKnowledge(bank, max_neighbors=config.neighbors),
                      checkpoints=store, checkpoint_every=config.checkpoint_every)
    trainer.save_checkpoint()  # version 0: makers fill the bank while the trainer warms up
    with makers_running([(maker, store) for maker in makers], bank, client):
        trainer.fit(batches(data, features, config, seed, config.multiplier), config.steps,
                    progress=progress, live=False)
    staleness = [r["staleness"] for r in trainer.history if "staleness" in r and np.isfinite(r["staleness"])]
    extra = {"maker_status": [m.status() for m in makers],
             "mean_staleness": float(np.mean(staleness)) if staleness else None,
             "missing_neighbors": int(trainer.knowledge.missing_total)}
    return _result(trainer, data, features, started, extra, make_model)


def select_checkpoint(trainer: Trainer, versions, make_model, features: np.ndarray, data: Dataset) -> dict:
    """Of the trainer's checkpoints ``versions`` (and its current state), the model most accurate on
    ``data``'s validation split; the latest wins ties, and the current state when there is no
    validation split. Returns ``{"step", "val_acc", "model"}`` (the model a new one from ``make_model``)."""
    trainer.save_checkpoint()  # the current state is a candidate too (no-op if already published)
    model = make_model()
    candidates = sorted({int(v) for v in versions} | {trainer.step}) if len(data.val_idx) else [trainer.step]
    best = None
    for version in candidates:
        if trainer.checkpoints is None or version == trainer.step:
            state = trainer.checkpoint_tree()["model"]
        else:
            state = trainer.checkpoints.load(version, target=trainer.checkpoint_tree())[0]["model"]
        nnx.update(model, state)
        score = accuracy(model, features, data.labels, data.val_idx) if len(data.val_idx) else float("nan")
        if best is None or score >= best[1]:
            best = (version, score, state)
    nnx.update(model, best[2])
    return {"step": best[0], "val_acc": best[1], "model": model}


def _result(trainer: Trainer, data: Dataset, features: np.ndarray, started: float, extra: dict, make_model) -> dict:
    selected = select_checkpoint(trainer, trainer.checkpoints.versions(), make_model, features, data)
    return {"test_acc": accuracy(selected["model"], features, data.labels, data.test_idx),
            "val_acc": selected["val_acc"], "selected_step": selected["step"],
            "last_val_acc": accuracy(trainer.model, features, data.labels, data.val_idx),
            "steps": trainer.step, "seconds": time.perf_counter() - started, "history": trainer.history, **extra}


def compare(data: Dataset, config: GraphRegConfig, *, seed: int = 0, client: Any = None, num_shards: int = 1,
            progress: bool | str = False) -> dict:
    """Train the same MLP without and with graph regularization; the command's JSON fields."""
    base = train(data, config, regularize=False, seed=seed, progress=progress and f"{data.name}: MLP alone")
    graph = train(data, config, regularize=True, seed=seed, client=client, num_shards=num_shards,
                  progress=progress and f"{data.name}: MLP + graph regularization")
    return {
        "data": data.name, "base_test_acc": base["test_acc"], "graph_reg_test_acc": graph["test_acc"],
        "base_val_acc": base["val_acc"], "graph_reg_val_acc": graph["val_acc"], "val_acc": graph["val_acc"],
        "selected_step": graph["selected_step"], "base_selected_step": base["selected_step"],
        "steps": graph["steps"], "seconds": base["seconds"] + graph["seconds"],
        "mean_staleness": graph["mean_staleness"], "missing_neighbors": graph["missing_neighbors"],
        "config": asdict(config), "seed": seed,
    }


def load_data(name: str, label_fraction: float, seed: int) -> Dataset:
    """``digits`` (scikit-learn's, ``label_fraction`` of it labelled) or a Planetoid graph by name or path."""
    if name == "digits":
        return load_digits(label_fraction, seed=seed)
    return load_planetoid(name)


def main(argv: list[str] | None = None) -> dict:
    """The command line (``python -m carlskit.paradigms.graph_reg --help``): trains the MLP with and
    without graph regularization and prints one JSON line with both accuracies."""
    args = parse_arguments("graph_reg", argv)  # --data is already resolved to a file (or 'digits')
    data = load_data(args.data, args.label_fraction, args.seed)
    say(f"graph_reg: {data}", args.quiet)
    config = DIGITS_CONFIG if data.edges is None else GraphRegConfig()
    config = replace(config, **({"neighbors": args.neighbors} if args.neighbors else {}),
                     **({"steps": args.steps} if args.steps else {}))
    return run_and_print(args.workers, lambda client, num_shards: compare(
        data, config, seed=args.seed, client=client, num_shards=num_shards, progress=not args.quiet), quiet=args.quiet)


if __name__ == "__main__":
    main()
