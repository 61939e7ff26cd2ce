"""Graph Agreement Models with CARLS (paper section 4.2.2; Stretcu et al. 2019, NeurIPS).

Two models are co-trained in rounds, each with its own Trainer and CheckpointStore:

* the **agreement model** g(x_i, x_j) = sigmoid(w . (h_i - h_j)^2 + b), h = relu(W x) shared by
  both items, learns from pairs of labelled items (given + self-labelled) whether they share a label:
  loss = binary cross-entropy(g(x_i, x_j), [y_i == y_j]), pairs drawn half from the same class.
  Its x is an item's features joined with the mean of its neighbours' features
  (``agreement_neighborhood``): on a graph whose own features are weak, raw features alone left
  every edge scored near chance (issue 19);
* the **classifier** (graph_reg's MLP) trains on

      loss = CE(labelled + accepted self-labels)
             + multiplier * mean_i (1 / K_i) sum_k a_ik * || p(x_i) - bank_p(neighbour_ik) ||^2

  where the neighbours' class distributions bank_p come from the bank (an embedding maker follows
  the classifier's checkpoints, as in graph regularization) and the agreement weights a_ik too: an
  **agreement maker** scores every edge with the agreement model's latest checkpoint and writes
  (neighbour ids, agreement weights, version) per item;
* a **self-labelling maker** (LabelMaker) writes (label, confidence, version) for every unlabelled
  item from the classifier's latest checkpoint. After each round the ``self_labels_per_round`` most
  confident items whose confidence exceeds ``confidence_threshold`` join the labelled set, balanced
  over classes (GAM's co-training curriculum); the agreement model trains on them the next round.

The result is the classifier checkpoint (one every ``checkpoint_every`` steps, any round) most
accurate on the validation split, as in the GAM paper: ``selected_round``, ``selected_step`` and
``val_acc`` say which; ``last_test_acc`` is the last round's end.

Command line (prints one JSON object as its last line)::

    python -m carlskit.paradigms.gam [--data cora] [--seed S] [--workers N] [--rounds R] [--steps N]
"""

from __future__ import annotations

if __name__ == "__main__":  # answer --help and usage errors before JAX is imported (~0.3 s, not ~15 s)
    from carlskit.paradigms._cli import parse_arguments

    parse_arguments("gam")

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

from carlskit._history import History
from carlskit._notebook import LoopDisplay
from carlskit.bank import KnowledgeBank
from carlskit.data import Dataset, neighbors_from_edges
from carlskit.makers import AgreementMaker, EmbeddingMaker, LabelMaker, Maker
from carlskit.paradigms._cli import makers_running, parse_arguments, run_and_print, say
from carlskit.paradigms.graph_reg import MLP, _features, accuracy, batches, encode, load_data, select_checkpoint
from carlskit.training import CheckpointStore, NeighborKnowledge, Trainer, graph_regularization, masked_cross_entropy


class AgreementModel(nnx.Module):
    """Predicts whether two items share a label: g = sigmoid(w . (h_i - h_j)^2 + b), h = relu(W x).

    Symmetric in its two items by construction (GAM's "distance" aggregation, Stretcu et al. 3.1).
    """

    def __init__(self, num_features: int, hidden: int, *, dropout: float, seed: int):
        rngs = nnx.Rngs(params=seed, dropout=seed + 1)
        self.encoder = nnx.Linear(num_features, hidden, rngs=rngs)
        self.head = nnx.Linear(hidden, 1, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, left: jax.Array, right: jax.Array, *, deterministic: bool = False) -> jax.Array:
        """Agreement logits [B] for item pairs ``left`` [B, D], ``right`` [B, D]."""
        encoded = [nnx.relu(self.encoder(self.dropout(x, deterministic=deterministic))) for x in (left, right)]
        return self.logits(*encoded)

    def logits(self, h_left: jax.Array, h_right: jax.Array) -> jax.Array:
        return self.head((h_left - h_right) ** 2)[..., 0]

    def embed(self, x: jax.Array) -> jax.Array:
        """Dropout-free encoding h = relu(W x), [n, hidden]."""
        return nnx.relu(self.encoder(x))

    def agreement(self, h_left: jax.Array, h_right: jax.Array) -> jax.Array:
        """Probability in [0, 1] that two encoded items share a label (broadcasts over leading axes)."""
        return jax.nn.sigmoid(self.logits(h_left, h_right))


@dataclass(frozen=True)
class GAMConfig:
    """Hyperparameters (chosen on Cora's validation split only)."""

    neighbors: int = 32
    multiplier: float = 5.0
    distance: str = "l2"
    hidden: int = 64
    dropout: float = 0.5
    learning_rate: float = 0.01
    weight_decay: float = 5e-4
    batch_size: int = 1024
    warmup_steps: int = 50
    checkpoint_every: int = 10
    rounds: int = 6
    classifier_steps: int = 100  # per round; the classifier keeps training across rounds
    agreement_steps: int = 100  # per round
    agreement_hidden: int = 64
    agreement_batch_size: int = 256
    agreement_learning_rate: float = 0.003
    self_labels_per_round: int = 200
    confidence_threshold: float = 0.8  # Cora validation, seed 1: 0.800 vs 0.770 at 0.0
    agreement_neighborhood: bool = True  # the agreement model also sees the mean of each item's neighbours' features
    row_normalize: bool = True  # bag-of-words features (Planetoid); False for dense features (digits)


# For digits with a 5-nearest-neighbour feature graph (``with_knn_edges``): pixel features as they are.
DIGITS_CONFIG = GAMConfig(row_normalize=False, dropout=0.2, hidden=256, neighbors=8)


def agreement_loss_fn(model: AgreementModel, batch: dict) -> tuple[jax.Array, dict]:
    """Binary cross-entropy of the agreement logits against [y_i == y_j]."""
    logits = model(batch["left"], batch["right"])
    targets = batch["agree"].astype(logits.dtype)
    loss = jnp.mean(optax.sigmoid_binary_cross_entropy(logits, targets))
    return loss, {"agreement_acc": jnp.mean((logits > 0) == batch["agree"])}


def classifier_loss_fn(model: MLP, batch: dict, *, distance: str) -> tuple[jax.Array, dict]:
    """CE on the labelled items + multiplier * mean_i (1/K_i) sum_k a_ik distance(p_i, bank_p_ik)."""
    logits = model(batch["features"])
    supervised = masked_cross_entropy(logits, batch["labels"], batch["labelled"])
    if "neighbor_embeddings" not in batch:
        return supervised, {"supervised": supervised}
    samples = model.embed(batch["features"])["emb"]
    weights = batch["neighbor_weights"] / jnp.maximum(batch["degree"], 1.0)[:, None]
    regularizer = graph_regularization(samples, batch["neighbor_embeddings"], weights, distance)
    return supervised + batch["multiplier"] * regularizer, {
        "supervised": supervised, "graph": regularizer, "mean_agreement": jnp.sum(batch["neighbor_weights"])
        / jnp.maximum(jnp.sum(jnp.minimum(batch["degree"], batch["neighbor_weights"].shape[1])), 1.0)}


def agreement_batches(features: np.ndarray, labels: np.ndarray, labelled: np.ndarray, batch_size: int, seed: int):
    """f(step) -> ``batch_size`` pairs of labelled items, half of them drawn from the same class."""
    labelled = np.asarray(labelled, np.int64)
    if labelled.ndim != 1 or len(labelled) < 2:
        raise ValueError(f"labelled must be a 1-D array of at least 2 item ids, got shape {labelled.shape}")
    rng = np.random.default_rng(seed)
    by_class = labelled[np.argsort(labels[labelled], kind="stable")]
    classes = labels[by_class]
    first = np.searchsorted(classes, labels[labelled], side="left")
    count = np.searchsorted(classes, labels[labelled], side="right") - first

    def batch(step: int) -> dict:
        pick = rng.integers(0, len(labelled), batch_size)
        left = labelled[pick]
        same_class = by_class[first[pick] + rng.integers(0, count[pick])]
        right = np.where(rng.random(batch_size) < 0.5, same_class, rng.choice(labelled, batch_size))
        return {"left": features[left], "right": features[right], "agree": labels[left] == labels[right]}

    return batch


def neighborhood_features(features: np.ndarray, neighbor_ids: np.ndarray) -> np.ndarray:
    """``[features, mean of the neighbours' features]`` per item ([n, 2D]; zeros for an item without
    neighbours): what the agreement model compares. On a homophilous graph whose own features are weak,
    an item's neighbourhood says more about its class than the item itself, and a model that sees only
    raw features scores every edge near chance (issue 19)."""
    features = np.asarray(features, np.float32)
    present = (neighbor_ids >= 0).astype(np.float32)
    total = np.zeros_like(features)
    for column in range(neighbor_ids.shape[1]):  # K gathers of [n, D], not one [n, K, D] array
        total += present[:, column, None] * features[np.maximum(neighbor_ids[:, column], 0)]
    return np.concatenate([features, total / np.maximum(present.sum(axis=1, keepdims=True), 1.0)], axis=1)


def select_self_labels(labels: np.ndarray, confidence: np.ndarray, count: int, threshold: float,
                       num_classes: int) -> np.ndarray:
    """Positions of the candidates to self-label: per class, the ``count // num_classes`` most
    confident candidates predicted as that class whose confidence is above ``threshold``."""
    labels, confidence = np.asarray(labels), np.asarray(confidence)
    if labels.shape != confidence.shape or labels.ndim != 1:
        raise ValueError(f"labels and confidence must be [n] arrays, got {labels.shape} and {confidence.shape}")
    per_class = max(count // num_classes, 1)
    chosen = []
    for label in range(num_classes):
        candidates = np.flatnonzero((labels == label) & (confidence > threshold))
        chosen.append(candidates[np.argsort(-confidence[candidates], kind="stable")[:per_class]])
    return np.sort(np.concatenate(chosen)).astype(np.int64)


def with_knn_edges(data: Dataset, k: int = 5) -> Dataset:
    """``data`` with a graph of each item's ``k`` nearest neighbours by cosine similarity of its
    features (for data sets without a given graph, e.g. digits); edges are undirected, deduplicated."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    features = data.features / np.maximum(np.linalg.norm(data.features, axis=1, keepdims=True), 1e-12)
    similarity = features @ features.T
    np.fill_diagonal(similarity, -np.inf)
    nearest = np.argsort(-similarity, axis=1)[:, :k]
    pairs = np.stack([np.repeat(np.arange(data.num_items), k), nearest.ravel()], axis=1)
    edges = np.unique(np.sort(pairs, axis=1), axis=0).astype(np.int64)
    return replace(data, name=f"{data.name}-knn{k}", edges=edges)


def train(data: Dataset, config: GAMConfig, *, seed: int = 0, client: Any = None, num_shards: int = 1,
          workdir: str | None = None, progress: bool | str = False, live: bool = False) -> dict:
    """Co-train the agreement model and the classifier for ``config.rounds`` rounds with the bank
    and three makers (embeddings, agreement weights, self-labels). Returns accuracies per round,
    the self-labels' accuracy, maker statuses and both trainers' histories. ``live`` displays one
    plot of both losses and the per-round validation accuracy, updated while training (notebooks)."""
    if data.edges is None:
        raise ValueError("GAM needs a graph: data.edges is None")
    with tempfile.TemporaryDirectory(prefix="carlskit-gam-") as scratch:
        bank = KnowledgeBank(client=client, num_shards=num_shards)
        try:
            return _co_train(data, config, bank, client, max(1, num_shards), workdir or scratch, seed, progress, live)
        finally:
            bank.close()


def _co_train(data, config, bank, client, slices, workdir, seed, progress, live) -> dict:
    started = time.perf_counter()
    features = _features(data) if config.row_normalize else data.features
    run = _build(data, config, bank, slices, workdir, seed, features)
    classifier, agreement, makers = run["classifier"], run["agreement"], run["makers"]
    agreement.save_checkpoint()
    classifier.save_checkpoint()
    run.update(working_labels=np.maximum(data.labels, 0).copy(), labelled=data.train_idx.copy(), best=None)
    rounds = []
    display = _live_view(classifier, agreement, rounds) if live else None
    refresh = display.refresh if live else (lambda force=False: None)
    with makers_running(list(makers.values()), bank, client):
        for round_index in range(config.rounds):
            rounds.append(_co_training_round(run, round_index, data, config, features, seed, progress, refresh))
            refresh(force=True)
    if display is not None:
        display.show_final_frames()  # the saved output shows the last frame (main thread)
    items = run["items"]
    versions = bank.row_metadata("nbrs", items)["version"]
    edges, _ = bank.lookup("nbrs", items)
    best = run["best"]
    return {"test_acc": accuracy(best["model"], features, data.labels, data.test_idx), "val_acc": best["val_acc"],
            "selected_round": best["round"], "selected_step": best["step"],
            "last_test_acc": accuracy(classifier.model, features, data.labels, data.test_idx),
            "steps": classifier.step, "agreement_steps": agreement.step, "rounds": rounds,
            "seconds": time.perf_counter() - started, "history": classifier.history,
            "agreement_history": agreement.history, "agreement_version": int(versions.min()),
            "missing_neighbors": int(classifier.knowledge.missing_total),
            "neighbor_ids": edges["ids"], "agreement_weights": edges["weights"], "labelled": run["labelled"],
            "maker_status": {name: maker.status() for name, (maker, _) in makers.items()}}


def _build(data, config, bank, slices, workdir, seed, features) -> dict:
    """The two trainers, the bank's tables and the three makers of a co-training run."""
    make_classifier = functools.partial(MLP, data.num_features, config.hidden, data.num_classes,
                                        dropout=config.dropout, seed=seed)
    items = np.arange(data.num_items, dtype=np.int64)
    unlabelled = np.setdiff1d(items, data.train_idx)
    neighbor_ids, neighbor_weights = neighbors_from_edges(data.edges, data.num_items, config.neighbors, seed=seed)
    pair_features = neighborhood_features(features, neighbor_ids) if config.agreement_neighborhood else features
    make_agreement = functools.partial(AgreementModel, pair_features.shape[1], config.agreement_hidden,
                                       dropout=config.dropout, seed=seed + 7)
    bank.create_table("emb", dim=data.num_classes, initializer="zeros")
    bank.create_feature_table("nbrs", schema=AgreementMaker.schema(config.neighbors))
    bank.create_feature_table("labels", schema=LabelMaker.SCHEMA)
    agreement = Trainer(make_agreement(), optax.adamw(config.agreement_learning_rate, weight_decay=config.weight_decay),
                        agreement_loss_fn, checkpoints=CheckpointStore(f"{workdir}/agreement", keep=3),
                        checkpoint_every=config.agreement_steps)
    # A round's checkpoints stay until the round's end, when the one most accurate on validation is kept.
    classifier_store = CheckpointStore(f"{workdir}/classifier",
                                       keep=max(3, config.classifier_steps // config.checkpoint_every + 2))
    classifier = Trainer(make_classifier(), optax.adamw(config.learning_rate, weight_decay=config.weight_decay),
                         functools.partial(classifier_loss_fn, distance=config.distance),
                         knowledge=NeighborKnowledge(bank, max_neighbors=config.neighbors),
                         checkpoints=classifier_store, checkpoint_every=config.checkpoint_every)
    makers = {
        "agreement": (Maker(AgreementMaker(make_agreement, pair_features, neighbor_ids), items, num_slices=slices,
                            name="agreement"), agreement.checkpoints),
        "embeddings": (Maker(EmbeddingMaker(make_classifier, encode, features), items, num_slices=slices,
                             name="embeddings"), classifier_store),
        "self_labels": (Maker(LabelMaker(make_classifier, features), unlabelled, num_slices=slices,
                              name="self_labels"), classifier_store),
    }
    return {"classifier": classifier, "agreement": agreement, "makers": makers, "items": items, "bank": bank,
            "unlabelled": unlabelled, "pair_features": pair_features,
            "degree": neighbor_weights.sum(axis=1).astype(np.float32),
            "make_classifier": make_classifier}


def _co_training_round(run, round_index, data, config, features, seed, progress, refresh) -> dict:
    """One round: the agreement model, then the classifier, then self-labels; keeps the classifier
    checkpoint most accurate on validation so far in ``run["best"]``."""
    classifier, agreement, makers = run["classifier"], run["agreement"], run["makers"]
    round_seed, first_step = seed * 1000 + round_index, classifier.step
    label = progress and f"GAM round {round_index + 1}/{config.rounds}"
    pairs = agreement_batches(run["pair_features"], run["working_labels"], run["labelled"], config.agreement_batch_size,
                              round_seed)
    agreement.fit(functools.partial(_observed, pairs, refresh), config.agreement_steps,
                  progress=label and f"{label}: agreement model", live=False)
    agreement.save_checkpoint()
    makers["agreement"][0].wait_for_version(agreement.step)
    source = batches(replace(data, labels=run["working_labels"], train_idx=run["labelled"]), features, config,
                     round_seed, config.multiplier)
    classifier.fit(functools.partial(_observed, functools.partial(_with_degree, source, run["degree"]), refresh),
                   config.classifier_steps, progress=label and f"{label}: classifier", live=False)
    classifier.save_checkpoint()
    selected = select_checkpoint(classifier, [v for v in classifier.checkpoints.versions() if v > first_step],
                                 run["make_classifier"], features, data)
    if run["best"] is None or selected["val_acc"] >= run["best"]["val_acc"]:
        run["best"] = {**selected, "round": round_index}
    makers["self_labels"][0].wait_for_version(classifier.step)
    added = _accept_self_labels(run["bank"], data, config,
                                run["unlabelled"], run["labelled"], run["working_labels"])
    run["labelled"] = np.union1d(run["labelled"], added)
    return {**_round_record(round_index, classifier, agreement, data, features, run["labelled"],
                            run["working_labels"], added),
            "best_val_acc": selected["val_acc"], "best_step": selected["step"]}


def _live_view(classifier: Trainer, agreement: Trainer, rounds: list[dict]) -> LoopDisplay:
    """Display one live plot of both trainers' losses and the per-round validation accuracy (the
    loops' :class:`~carlskit._notebook.LoopDisplay`, without a bar: each trainer shows its own);
    its ``refresh(force=False)`` is cheap to call every step (it renders at most once a second)."""
    return LoopDisplay(classifier.history, len(rounds), "GAM", progress=False, live=True, title="GAM co-training",
                       width_inches=10.0, curves=lambda: {
                           "classifier loss": classifier.history.series("loss"),
                           "agreement loss": agreement.history.series("loss"),
                           "validation accuracy (per round)": History(rounds).series("val_acc")})


def _observed(source, refresh, step: int) -> dict:
    refresh()
    return source(step)


def _with_degree(source, degree: np.ndarray, step: int) -> dict:
    batch = source(step)
    return {**batch, "degree": degree[batch["ids"]]}


def _accept_self_labels(bank, data, config, unlabelled, labelled, working_labels) -> np.ndarray:
    """Read the self-labelling maker's records and accept this round's most confident new items."""
    candidates = np.setdiff1d(unlabelled, labelled)
    records, found = bank.lookup("labels", candidates)
    confidence = np.where(found, records["confidence"][:, 0], 0.0)
    predicted = records["label"][:, 0]
    chosen = select_self_labels(predicted, confidence, config.self_labels_per_round,
                                config.confidence_threshold, data.num_classes)
    working_labels[candidates[chosen]] = predicted[chosen]
    return candidates[chosen]


def _round_record(round_index, classifier, agreement, data, features, labelled, working_labels, added) -> dict:
    self_labelled = np.setdiff1d(labelled, data.train_idx)
    true = data.labels[self_labelled]
    known = true >= 0
    last = agreement.history[-1]
    return {"round": round_index, "step": classifier.step,
            "val_acc": accuracy(classifier.model, features, data.labels, data.val_idx),
            "test_acc": accuracy(classifier.model, features, data.labels, data.test_idx),
            "agreement_train_acc": last["agreement_acc"], "added": len(added), "labelled": len(labelled),
            "self_label_acc": float(np.mean(working_labels[self_labelled][known] == true[known]))
            if known.any() else None}


def compare(data: Dataset, config: GAMConfig, *, seed: int = 0, client: Any = None, num_shards: int = 1,
            progress: bool | str = False) -> dict:
    """The plain MLP (same steps) against GAM co-training; the command's JSON fields."""
    from carlskit.paradigms.graph_reg import GraphRegConfig
    from carlskit.paradigms.graph_reg import train as train_mlp

    steps = config.rounds * config.classifier_steps
    mlp_config = GraphRegConfig(hidden=config.hidden, dropout=config.dropout, learning_rate=config.learning_rate,
                                weight_decay=config.weight_decay, steps=steps, batch_size=config.batch_size)
    base = train_mlp(data, mlp_config, regularize=False, seed=seed, progress=progress and f"{data.name}: MLP alone")
    gam = train(data, config, seed=seed, client=client, num_shards=num_shards, progress=progress)
    return {
        "data": data.name, "base_test_acc": base["test_acc"], "gam_test_acc": gam["test_acc"],
        "base_val_acc": base["val_acc"], "gam_val_acc": gam["val_acc"],
        "rounds": gam["rounds"], "selected_round": gam["selected_round"], "selected_step": gam["selected_step"],
        "val_acc": gam["val_acc"], "base_selected_step": base["selected_step"],
        "steps": gam["steps"], "agreement_steps": gam["agreement_steps"],
        "seconds": base["seconds"] + gam["seconds"], "missing_neighbors": gam["missing_neighbors"],
        "config": asdict(config), "seed": seed,
    }


def main(argv: list[str] | None = None) -> dict:
    """The command line (``python -m carlskit.paradigms.gam --help``): one JSON line with the test
    accuracy of the graph agreement model and its baselines."""
    args = parse_arguments("gam", argv)  # --data is already resolved to a file
    data = load_data(args.data, 0.05, args.seed)
    say(f"gam: {data}", args.quiet)
    config = replace(GAMConfig(), **({"rounds": args.rounds} if args.rounds else {}),
                     **({"classifier_steps": args.steps, "agreement_steps": args.steps} if args.steps else {}))
    return run_and_print(args.workers, lambda client, num_shards: compare(
        data, config, seed=args.seed, client=client, num_shards=num_shards, progress=not args.quiet), quiet=args.quiet)


if __name__ == "__main__":
    main()
