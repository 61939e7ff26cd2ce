"""A graph neural network whose neighbour embeddings are served by the knowledge bank (CARLS paper
section 4.1, figure 3).

A node encoder (an MLP on the bag-of-words features) and one GCN-style aggregation layer::

    h_i = relu(W_e x_i + b_e)                                   the node encoder
    z_i = (h_i + sum_k w_ik h_nk) / (1 + sum_k w_ik)            row-normalised aggregation, self-loop
    logits_i = W_o z_i + b_o

The trainer encodes only the batch's own nodes (the encoder's gradient flows through ``h_i``); the
neighbours' ``h_nk`` are constants of the step, read from the bank (ids and weights in the feature
table ``nbrs``, embeddings in the embedding table ``hidden``) where an embedding maker wrote them from
the latest checkpoint, as GNNAutoScale serves "historical" embeddings. How old they may be is
controlled: at most ``max_staleness`` checkpoint versions behind the newest checkpoint, beyond which
the trainer waits for the maker (``on_stale="wait"``) or re-encodes the stale neighbours itself
from the newest checkpoint (``"reencode"``). A neighbour maker can rebuild the graph from the latest
embeddings (``bank.nearest``), mixed with the given graph by ``refresh_mix``.

The reference is the same model trained in one process on the full graph, the aggregation over
every edge written plainly in JAX (:func:`propagate`); with fresh embeddings and every neighbour
served, the two compute the same function (Kipf & Welling's GCN with D^-1 (A + I) normalisation and
the first propagation replaced by the encoder).

Command line (prints one JSON object as its last line)::

    python -m carlskit.paradigms.gnn [--data cora] [--neighbors K] [--max-staleness V] [--seed S]
"""

from __future__ import annotations

if __name__ == "__main__":  # answer --help and usage errors before JAX is imported
    from carlskit.paradigms._cli import parse_arguments

    parse_arguments("gnn")

import bisect
import functools
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from carlskit._checks import instance, integer
from carlskit._step import make_train_step
from carlskit.bank import KnowledgeBank
from carlskit.data import Dataset, load_planetoid, neighbors_from_edges
from carlskit.makers import EmbeddingMaker, Maker, NeighborMaker
from carlskit.paradigms._cli import makers_running, parse_arguments, run_and_print, say
from carlskit.training import CheckpointStore, NeighborKnowledge, Trainer, check_embedding_dim, masked_cross_entropy


# -- the model and the full-graph reference --------------------------------------------------------
def aggregate(own: jax.Array, neighbor_embeddings: jax.Array, neighbor_weights: jax.Array) -> jax.Array:
    """z_i = (h_i + sum_k w_ik n_ik) / (1 + sum_k w_ik): ``own`` [B, D], ``neighbor_embeddings``
    [B, K, D], ``neighbor_weights`` [B, K] (0 for padding); ValueError naming the shapes otherwise."""
    b, d = own.shape if own.ndim == 2 else (None, None)
    if b is None or neighbor_embeddings.ndim != 3 or neighbor_embeddings.shape[::2] != (b, d) or \
            neighbor_weights.shape != neighbor_embeddings.shape[:2]:
        raise ValueError(f"expected own [B, D], neighbor_embeddings [B, K, D] and neighbor_weights [B, K]; got "
                         f"{own.shape}, {neighbor_embeddings.shape} and {neighbor_weights.shape}")
    summed = jnp.einsum("bk,bkd->bd", neighbor_weights, neighbor_embeddings)
    return (own + summed) / (1.0 + neighbor_weights.sum(axis=1, keepdims=True))


def symmetric_edges(edges: np.ndarray, num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """``(senders, receivers)`` int32: every undirected edge in both directions once, no self-loops."""
    edges = np.asarray(edges)
    if edges.ndim != 2 or edges.shape[1] != 2:
        raise ValueError(f"edges must have shape [M, 2], got {edges.shape}")
    if edges.size and (edges.min() < 0 or edges.max() >= num_nodes):
        raise ValueError(f"edges must be node ids in [0, {num_nodes}), got [{edges.min()}, {edges.max()}]")
    both = np.unique(np.concatenate([edges, edges[:, ::-1]]).reshape(-1, 2), axis=0)
    both = both[both[:, 0] != both[:, 1]]
    return both[:, 0].astype(np.int32), both[:, 1].astype(np.int32)


def propagate(embeddings: jax.Array, senders: jax.Array, receivers: jax.Array) -> jax.Array:
    """Full-graph GCN aggregation z = D~^-1 (A + I) h: z_i = (h_i + sum_{j in N(i)} h_j) / (1 + |N(i)|),
    with the edges given once in each direction (:func:`symmetric_edges`)."""
    num_nodes = embeddings.shape[0]
    summed = jax.ops.segment_sum(embeddings[senders], receivers, num_nodes)
    degree = jax.ops.segment_sum(jnp.ones(senders.shape, embeddings.dtype), receivers, num_nodes)
    return (embeddings + summed) / (1.0 + degree)[:, None]


class GNN(nnx.Module):
    """Node encoder (one hidden layer, dropout) + one aggregation layer + a linear classifier."""

    def __init__(self, num_features: int, hidden: int, num_classes: int, *, dropout: float, seed: int):
        rngs = nnx.Rngs(params=seed, dropout=seed + 1)
        self.encoder = nnx.Linear(num_features, hidden, rngs=rngs)
        self.output = nnx.Linear(hidden, num_classes, rngs=rngs)
        self.input_dropout = nnx.Dropout(dropout, rngs=rngs)
        self.hidden_dropout = nnx.Dropout(dropout, rngs=rngs)

    def encode(self, features: jax.Array, *, deterministic: bool = True) -> jax.Array:
        """h = relu(W_e x + b_e): what the maker writes to the bank (dropout-free)."""
        return nnx.relu(self.encoder(self.input_dropout(features, deterministic=deterministic)))

    def classify(self, aggregated: jax.Array, *, deterministic: bool = True) -> jax.Array:
        return self.output(self.hidden_dropout(aggregated, deterministic=deterministic))

    def __call__(self, features: jax.Array, neighbor_embeddings: jax.Array, neighbor_weights: jax.Array,
                 neighbor_position: jax.Array | None = None, gradient_scale: jax.Array | None = None, *,
                 deterministic: bool = False) -> jax.Array:
        """Logits of the batch's nodes; a neighbour that is itself in the batch (``neighbor_position``
        [B, K] its row, -1 otherwise) enters with the batch's fresh encoding (the gradient flows
        through it), the others with their bank embedding (a constant), as in GNNAutoScale.

        ``gradient_scale`` [B, K] multiplies the gradient through in-batch neighbours, not their value:
        with 1 / P(neighbour drawn into the batch) the step's gradient is an unbiased estimate of the
        full-graph one (the encoder learns from neighbours' features as in the full-graph GCN;
        without it, Cora lost 1-2 points)."""
        own = self.encode(features, deterministic=deterministic)
        if neighbor_position is not None:
            fresh = own[jnp.maximum(neighbor_position, 0)]
            if gradient_scale is not None:
                constant = jax.lax.stop_gradient(fresh)
                fresh = constant + gradient_scale[..., None] * (fresh - constant)
            neighbor_embeddings = jnp.where((neighbor_position >= 0)[..., None], fresh, neighbor_embeddings)
        return self.classify(aggregate(own, neighbor_embeddings, neighbor_weights), deterministic=deterministic)

    def full_graph(self, features: jax.Array, senders: jax.Array, receivers: jax.Array, *,
                   deterministic: bool = False) -> jax.Array:
        """The reference forward pass: every node encoded, aggregated over every edge."""
        own = self.encode(features, deterministic=deterministic)
        return self.classify(propagate(own, senders, receivers), deterministic=deterministic)


def encode_hidden(model: GNN, features: jax.Array) -> jax.Array:
    """The embedding maker's encoder (picklable, module level)."""
    return model.encode(features)


@dataclass(frozen=True)
class GNNConfig:
    """Hyperparameters (Kipf & Welling's on Cora: lr 0.01, L2 5e-4, dropout 0.5, 200 steps; hidden 64)."""

    neighbors: int = 64
    hidden: int = 64
    dropout: float = 0.5
    learning_rate: float = 0.01
    weight_decay: float = 5e-4
    steps: int = 200
    batch_size: int = 1024  # nodes drawn per step besides the labelled ones (all of a Planetoid split's 120-140)
    checkpoint_every: int = 5
    max_staleness: int = 2  # checkpoint versions
    on_stale: str = "wait"  # or "reencode"
    stale_timeout_seconds: float = 120.0
    refresh_k: int = 0  # nearest neighbours from the embeddings per node; 0: the given graph only
    refresh_mix: float = 0.5  # weight of the refreshed neighbours (the given ones get 1 - refresh_mix)


def make_optimizer(config: GNNConfig) -> optax.GradientTransformation:
    """Adam with L2 weight decay added to the gradient (Kipf & Welling's, not AdamW's decoupled one)."""
    return optax.chain(optax.add_decayed_weights(config.weight_decay), optax.adam(config.learning_rate))


def _features(data: Dataset) -> np.ndarray:
    """Row-normalised bag-of-words, as is standard for Planetoid."""
    return (data.features / np.maximum(data.features.sum(axis=1, keepdims=True), 1.0)).astype(np.float32)


# -- staleness control --------------------------------------------------------------------------------
class StalenessGuard:
    """A knowledge stage that bounds how stale a batch's neighbour embeddings are (CARLS 3.3).

    Staleness of an embedding = how many checkpoints the trainer has published after the one that
    computed it (``checkpoints.versions()`` newer than its version). After ``knowledge`` (a
    :class:`~carlskit.training.NeighborKnowledge`) has read a batch, neighbours more than
    ``max_staleness`` versions behind are

    - ``on_stale="wait"``: waited for, re-reading the batch every ``poll_seconds`` until the maker has
      caught up (``TimeoutError`` after ``timeout_seconds``);
    - ``on_stale="reencode"``: encoded in the trainer's process by ``reencode(ids, version) -> [n, D]``
      from the newest checkpoint ``version``.

    Each batch reports ``_staleness_versions`` (the oldest neighbour after the guard),
    ``_staleness_read`` (as read from the bank), ``_stale_wait_seconds`` and ``_reencoded``
    (neighbours encoded in the trainer); the trainer logs them every step (its history, summaries
    and live plot).
    """

    def __init__(self, knowledge: Callable[[dict], dict], checkpoints: CheckpointStore, *, max_staleness: int,
                 on_stale: str = "wait", reencode: Callable[[np.ndarray, int], np.ndarray] | None = None,
                 timeout_seconds: float = 120.0, poll_seconds: float = 0.005):
        if not callable(knowledge):
            raise TypeError(f"knowledge must be callable as knowledge(batch) -> batch, got {type(knowledge).__name__}")
        instance(checkpoints, "checkpoints", CheckpointStore, "a CheckpointStore")
        self.max_staleness = integer(max_staleness, "max_staleness", 0)
        if on_stale not in ("wait", "reencode"):
            raise ValueError(f"on_stale must be 'wait' or 'reencode', got {on_stale!r}")
        if on_stale == "reencode" and not callable(reencode):
            raise TypeError("on_stale='reencode' needs reencode(ids, version) -> embeddings [n, D], got "
                            f"{type(reencode).__name__}")
        self.knowledge, self.checkpoints, self.on_stale, self.reencode = knowledge, checkpoints, on_stale, reencode
        self.timeout_seconds, self.poll_seconds = float(timeout_seconds), float(poll_seconds)

    @staticmethod
    def _behind(versions: list[int], version: float) -> float:
        """Checkpoints published after ``version`` (NaN: nothing read)."""
        if not np.isfinite(version):
            return np.nan
        return float(len(versions) - bisect.bisect_right(versions, int(version)))

    def __call__(self, batch: dict) -> dict:
        start = time.perf_counter()
        out = self.knowledge(batch)
        versions = self.checkpoints.versions()
        read = self._behind(versions, out["_oldest_embedding_version"])
        reencoded, waited_from = 0, time.perf_counter()
        if self.on_stale == "wait":
            while self._behind(versions, out["_oldest_embedding_version"]) > self.max_staleness:
                if time.perf_counter() - start > self.timeout_seconds:
                    raise TimeoutError(f"neighbour embeddings stayed more than max_staleness={self.max_staleness} "
                                       f"checkpoint versions behind for {self.timeout_seconds:g} s (oldest read: "
                                       f"version {out['_oldest_embedding_version']:g}, newest checkpoint "
                                       f"{versions[-1]}): is the embedding maker running?")
                time.sleep(self.poll_seconds)
                out = self.knowledge(batch)
                versions = self.checkpoints.versions()
        elif len(versions) > self.max_staleness:
            oldest_allowed = versions[-1 - self.max_staleness]
            stale = (out["_neighbor_ids"] >= 0) & (out["_neighbor_versions"] < oldest_allowed)
            if stale.any():
                ids, inverse = np.unique(out["_neighbor_ids"][stale], return_inverse=True)
                embeddings = out["neighbor_embeddings"].copy()
                embeddings[stale] = np.asarray(self.reencode(ids, versions[-1]), np.float32)[inverse]
                neighbor_versions = np.where(stale, versions[-1], out["_neighbor_versions"])
                oldest = float(neighbor_versions[out["_neighbor_ids"] >= 0].min())
                out = {**out, "neighbor_embeddings": embeddings, "_neighbor_versions": neighbor_versions,
                       "_oldest_embedding_version": oldest}
                reencoded = len(ids)
        return {**out, "_staleness_versions": self._behind(versions, out["_oldest_embedding_version"]),
                "_staleness_read": read, "_stale_wait_seconds": time.perf_counter() - waited_from
                if self.on_stale == "wait" else 0.0, "_reencoded": reencoded}


class CheckpointEncoder:
    """``encoder(ids, version) -> [n, D]``: the nodes' embeddings from checkpoint ``version`` of
    ``checkpoints`` (the model restored once per version; batches padded to powers of two so the
    jitted encoder compiles a few times, not once per size). The ``reencode`` of a StalenessGuard."""

    def __init__(self, make_model: Callable[[], nnx.Module], encode: Callable, features: np.ndarray,
                 checkpoints: CheckpointStore):
        self.model = make_model()
        self.features, self.checkpoints, self.version = features, checkpoints, None
        graphdef = nnx.graphdef(self.model)
        self._encode = jax.jit(lambda state, x: encode(nnx.merge(graphdef, state), x))

    def __call__(self, ids: np.ndarray, version: int) -> np.ndarray:
        if version != self.version:
            from carlskit.training import restore_model

            arrays, metadata = self.checkpoints.load(version)
            restore_model(self.model, arrays, metadata)
            self.version = version
        size = 1 << max(int(len(ids) - 1).bit_length(), 3)
        padded = np.zeros(size, np.int64)
        padded[: len(ids)] = ids
        return np.asarray(self._encode(nnx.state(self.model), self.features[padded]))[: len(ids)]


# -- training -------------------------------------------------------------------------------------
def bank_loss(model: GNN, batch: dict) -> tuple[jax.Array, dict]:
    """Cross-entropy on the batch's labelled nodes. A batch from :func:`node_batches` carries
    ``draw_probability``: unlabelled nodes enter a batch with it, labelled ones always (so only
    gradients through unlabelled in-batch neighbours are scaled by its inverse)."""
    scale = None
    if "draw_probability" in batch:
        position = batch["neighbor_position"]
        always = batch["labelled"][jnp.maximum(position, 0)]
        scale = jnp.where(always, 1.0, 1.0 / batch["draw_probability"])
    logits = model(batch["features"], batch["neighbor_embeddings"], batch["neighbor_weights"],
                   batch["neighbor_position"], scale)
    loss = masked_cross_entropy(logits, batch["labels"], batch["labelled"])
    return loss, {"supervised": loss}


def full_graph_loss(model: GNN, batch: dict) -> tuple[jax.Array, dict]:
    """Cross-entropy on the labelled nodes of the full-graph reference (every node encoded in the step)."""
    logits = model.full_graph(batch["features"], batch["senders"], batch["receivers"])[batch["index"]]
    loss = masked_cross_entropy(logits, batch["labels"], jnp.ones(batch["labels"].shape, bool))
    return loss, {"supervised": loss}


def node_batches(data: Dataset, features: np.ndarray, batch_size: int, seed: int) -> Callable[[int], dict]:
    """f(step) -> batch: every labelled node and
    ``batch_size`` other nodes drawn uniformly (``draw_probability`` = batch_size / their number), a
    fixed size whatever the step (one compilation)."""
    rng = np.random.default_rng(seed)
    train = np.asarray(data.train_idx, np.int64)
    others = np.setdiff1d(np.arange(data.num_items, dtype=np.int64), train)
    batch_size = min(batch_size, len(others))

    def batch(step: int) -> dict:
        ids = np.concatenate([train, rng.choice(others, batch_size, replace=False)])
        mask = np.arange(len(ids)) < len(train)
        return {"ids": ids, "features": features[ids], "labels": np.maximum(data.labels[ids], 0), "labelled": mask,
                "draw_probability": np.float32(batch_size / len(others))}

    return batch


def batch_positions(batch: dict) -> dict:
    """Add ``neighbor_position`` [B, K] int32: the batch row of each neighbour (``_neighbor_ids``)
    that is itself in the batch, -1 for the others (read from the bank)."""
    ids = np.asarray(batch["ids"])
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    neighbors = batch["_neighbor_ids"]
    at = np.minimum(np.searchsorted(sorted_ids, neighbors), len(ids) - 1)
    inside = (neighbors >= 0) & (sorted_ids[at] == neighbors)
    return {**batch, "neighbor_position": np.where(inside, order[at], -1).astype(np.int32),
            "_in_batch_neighbors": float(inside.sum() / max((neighbors >= 0).sum(), 1))}


@nnx.jit
def _predict_records(model: GNN, features: jax.Array, ids: jax.Array, weights: jax.Array) -> jax.Array:
    hidden = model.encode(features)
    real = ids >= 0
    neighbors = hidden[jnp.where(real, ids, 0)]
    return jnp.argmax(model.classify(aggregate(hidden, neighbors, jnp.where(real, weights, 0.0))), axis=-1)


def _select(trainer: Trainer, make_model: Callable[[], GNN], predict: Callable[[GNN], np.ndarray],
            data: Dataset) -> dict:
    """The checkpoint most accurate on the validation split (the latest wins ties); its test accuracy."""
    trainer.save_checkpoint()
    model = make_model()
    best = None
    for version in trainer.checkpoints.versions():
        nnx.update(model, trainer.checkpoints.load(version, target=trainer.checkpoint_tree())[0]["model"])
        predictions = predict(model)
        val = float(np.mean(predictions[data.val_idx] == data.labels[data.val_idx])) if len(data.val_idx) else 0.0
        if best is None or val >= best[1]:
            best = (version, val, float(np.mean(predictions[data.test_idx] == data.labels[data.test_idx])))
    return {"selected_step": best[0], "val_acc": best[1], "test_acc": best[2]}


def train_full_graph(data: Dataset, config: GNNConfig, *, seed: int = 0, use_graph: bool = True,
                     progress: bool | str = False) -> dict:
    """The reference: the same GNN trained in one process on the full graph (every node encoded,
    every edge aggregated by :func:`propagate`), a plain jitted JAX step with optax; ``use_graph=False``
    drops every edge: the MLP baseline (z_i = h_i). Checkpoints every ``checkpoint_every`` steps are
    kept in memory; the one most accurate on validation (latest wins ties) gives the test accuracy."""
    features = jnp.asarray(_features(data))
    senders, receivers = map(jnp.asarray, symmetric_edges(data.edges if use_graph else np.zeros((0, 2), np.int64),
                                                          data.num_items))
    index = jnp.asarray(data.train_idx)
    labels = jnp.asarray(np.maximum(data.labels, 0))
    model = GNN(data.num_features, config.hidden, data.num_classes, dropout=config.dropout, seed=seed)

    def loss(net: GNN, batch: None) -> tuple[jax.Array, dict]:
        logits = net.full_graph(features, senders, receivers)[index]
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels[index]).mean(), {}

    # The trainer's own step function (carlskit/_step.py), jitted with the graph as constants.
    graphdef, state = nnx.split((model, nnx.Optimizer(model, make_optimizer(config), wrt=nnx.Param)))
    train_step = jax.jit(make_train_step(graphdef, loss, check_finite=False))

    @jax.jit
    def predict(state):
        net, _ = nnx.merge(graphdef, state)
        return jnp.argmax(net.full_graph(features, senders, receivers, deterministic=True), axis=-1)

    started = time.perf_counter()
    best, step_seconds = None, []
    for number in range(1, config.steps + 1):
        tick = time.perf_counter()
        state, value, _, _ = train_step(state, None)
        value.block_until_ready()
        step_seconds.append(time.perf_counter() - tick)
        if number % config.checkpoint_every == 0 or number == config.steps:
            predictions = np.asarray(predict(state))
            val = float(np.mean(predictions[data.val_idx] == data.labels[data.val_idx]))
            if best is None or val >= best[1]:
                best = (number, val, float(np.mean(predictions[data.test_idx] == data.labels[data.test_idx])))
    return {"selected_step": best[0], "val_acc": best[1], "test_acc": best[2],
            "seconds": time.perf_counter() - started, "median_step_seconds": float(np.median(step_seconds[5:]))}


def train_bank_gnn(data: Dataset, config: GNNConfig, *, seed: int = 0, client: Any = None, num_shards: int = 1,
                   progress: bool | str = False, live: bool = False, workdir: str | None = None,
                   summaries: Any = None) -> dict:
    """Train the GNN on bank-served neighbour embeddings with an embedding maker (and, with
    ``config.refresh_k``, a neighbour maker rebuilding the graph) beside the trainer; each step's
    record (loss, ``staleness_versions``, ``staleness_read``, ``stale_wait_seconds``, ``reencoded``,
    ...) goes to ``summaries`` (e.g. a :class:`carlskit.summaries.SummaryWriter`) as ``train/NAME``
    and, with ``live``, to the trainer's live plot. Returns the
    validation-selected checkpoint's accuracies (evaluated with every node's fresh embedding over the
    bank's final neighbour records), per-step staleness and maker statistics."""
    features = _features(data)
    make_model = functools.partial(GNN, data.num_features, config.hidden, data.num_classes,
                                   dropout=config.dropout, seed=seed)
    started = time.perf_counter()
    bank = KnowledgeBank(client=client, num_shards=num_shards)
    try:
        with tempfile.TemporaryDirectory(prefix="carlskit-gnn-") as scratch:
            store = CheckpointStore(f"{workdir or scratch}/checkpoints", keep=None)
            return _train_with_bank(data, config, features, make_model, bank, store, client, num_shards,
                                    progress, live, started, seed, summaries)
    finally:
        bank.close()


def _train_with_bank(data, config, features, make_model, bank, store, client, num_shards, progress, live,
                     started, seed, summaries) -> dict:
    width = config.neighbors + config.refresh_k
    bank.create_table("hidden", dim=config.hidden, initializer="zeros")
    bank.create_feature_table("nbrs", schema={"ids": ("int64", width), "weights": ("float32", width)})
    model = make_model()
    check_embedding_dim(bank, "hidden", int(model.encode(jnp.asarray(features[:1])).shape[-1]))
    items = np.arange(data.num_items, dtype=np.int64)
    given_ids, given_weights = neighbors_from_edges(data.edges, data.num_items, config.neighbors, seed=seed)
    slices = max(1, num_shards)
    makers = [Maker(EmbeddingMaker(make_model, encode_hidden, features, table="hidden"), items,
                    num_slices=slices, name="embeddings")]
    if config.refresh_k:
        makers.append(Maker(NeighborMaker(config.refresh_k, table="hidden", metric="cosine", given_ids=given_ids,
                                          given_weights=given_weights, mix=config.refresh_mix),
                            items, num_slices=slices, name="neighbors"))
    pad = np.full((data.num_items, width - config.neighbors), -1, np.int64)
    bank.update("nbrs", items, {"ids": np.concatenate([given_ids, pad], axis=1),
                                "weights": np.concatenate([given_weights, np.zeros(pad.shape, np.float32)], axis=1)},
                version=0)
    reencode = CheckpointEncoder(make_model, encode_hidden, features, store) if config.on_stale == "reencode" else None
    knowledge = StalenessGuard(NeighborKnowledge(bank, max_neighbors=width, embeddings_table="hidden"), store,
                               max_staleness=config.max_staleness, on_stale=config.on_stale, reencode=reencode,
                               timeout_seconds=config.stale_timeout_seconds)
    trainer = Trainer(model, make_optimizer(config), bank_loss,
                      knowledge=lambda batch: batch_positions(knowledge(batch)), checkpoints=store,
                      checkpoint_every=config.checkpoint_every, summaries=summaries)
    trainer.save_checkpoint()  # version 0: the makers fill the bank before the first step
    with makers_running([(maker, store) for maker in makers], bank, client):
        trainer.fit(node_batches(data, features, config.batch_size, seed), config.steps,
                    progress=progress, live=live)
    records, found = bank.lookup("nbrs", items)
    ids = np.where(found[:, None], records["ids"], -1)
    weights = np.where(ids >= 0, records["weights"], 0.0).astype(np.float32)
    x = jnp.asarray(features)
    result = _select(trainer, make_model,
                     lambda m: np.asarray(_predict_records(m, x, jnp.asarray(ids), jnp.asarray(weights))), data)
    history = trainer.history
    staleness = [r["staleness_versions"] for r in history if np.isfinite(r.get("staleness_versions", np.nan))]
    step_seconds = [r["step_seconds"] for r in history[5:]]
    return {**result, "seconds": time.perf_counter() - started, "history": history,
            "mean_staleness_versions": float(np.mean(staleness)) if staleness else None,
            "max_staleness_versions": float(np.max(staleness)) if staleness else None,
            "reencoded": int(sum(r.get("reencoded", 0) for r in history)),
            "stale_wait_seconds": float(sum(r.get("stale_wait_seconds", 0.0) for r in history)),
            "median_step_seconds": float(np.median(step_seconds)) if step_seconds else None,
            "maker_status": [m.status() for m in makers], "missing_neighbors": int(knowledge.knowledge.missing_total)}


def compare(data: Dataset, config: GNNConfig, *, seed: int = 0, client: Any = None, num_shards: int = 1,
            progress: bool | str = False) -> dict:
    """MLP baseline, full-graph reference GCN and bank-served GNN, same encoder and seed: the command's JSON."""
    base = train_full_graph(data, config, seed=seed, use_graph=False, progress=progress and f"{data.name}: MLP")
    gcn = train_full_graph(data, config, seed=seed, progress=progress and f"{data.name}: full-graph GCN")
    gnn = train_bank_gnn(data, config, seed=seed, client=client, num_shards=num_shards,
                         progress=progress and f"{data.name}: bank-served GNN")
    return {
        "data": data.name, "gnn_test_acc": gnn["test_acc"], "base_test_acc": base["test_acc"],
        "gcn_test_acc": gcn["test_acc"], "val_acc": gnn["val_acc"], "base_val_acc": base["val_acc"],
        "gcn_val_acc": gcn["val_acc"], "selected_step": gnn["selected_step"],
        "mean_staleness_versions": gnn["mean_staleness_versions"],
        "max_staleness_versions": gnn["max_staleness_versions"], "reencoded": gnn["reencoded"],
        "stale_wait_seconds": gnn["stale_wait_seconds"], "missing_neighbors": gnn["missing_neighbors"],
        "gnn_step_seconds": gnn["median_step_seconds"], "gcn_step_seconds": gcn["median_step_seconds"],
        "seconds": base["seconds"] + gcn["seconds"] + gnn["seconds"], "config": asdict(config), "seed": seed,
    }


def main(argv: list[str] | None = None) -> dict:
    """The command line (``python -m carlskit.paradigms.gnn --help``): trains the MLP and the GNN whose
    neighbour embeddings the bank serves, and prints one JSON line with both accuracies."""
    args = parse_arguments("gnn", argv)  # --data is already resolved to a file
    data = load_planetoid(args.data)
    say(f"gnn: {data}", args.quiet)
    overrides = {"neighbors": args.neighbors, "steps": args.steps, "max_staleness": args.max_staleness,
                 "on_stale": args.on_stale, "refresh_k": args.refresh_k, "refresh_mix": args.refresh_mix}
    config = replace(GNNConfig(), **{k: v for k, v in overrides.items() if v is not None})
    return run_and_print(args.workers, lambda client, num_shards: compare(
        data, config, seed=args.seed, client=client, num_shards=num_shards, progress=not args.quiet), quiet=args.quiet)


if __name__ == "__main__":
    main()
