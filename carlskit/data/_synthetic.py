"""Planetoid-format graphs drawn from a stochastic block model, with two knobs: how homophilous the
edges are and how much the bag-of-words features say about the class.

* **Edges**: ``num_nodes * mean_degree / 2`` undirected edges; each picks a uniformly random node,
  then with probability ``homophily`` a uniformly random other node of the same class, otherwise one
  of another class (self-loops and duplicates dropped). The fraction of edges whose two ends share a
  class (edge homophily) is therefore ``homophily`` up to sampling noise.
* **Features**: 0/1 word presence over ``num_features`` words, ``words_per_node`` draws per node
  (duplicates collapse, as in Cora). Each class owns a block of ``num_features / num_classes`` words;
  each draw comes from the node's class block with probability ``feature_signal`` and from the
  whole vocabulary otherwise. ``feature_signal`` 0 makes features independent of the class; 1 makes
  them name it.
* **Splits**, as Planetoid's: ``labels_per_class`` labelled nodes per class (``train_idx``), then
  ``num_val`` validation and ``num_test`` test nodes, all disjoint, drawn at random.

:func:`save_planetoid` writes the ``.npz`` that :func:`carlskit.data.load_planetoid` (and
``python -m carlskit.paradigms.gam --data FILE.npz``) reads.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np

from carlskit import _checks
from carlskit.data._datasets import Dataset


def synthetic_planetoid(*, num_nodes: int = 2400, num_classes: int = 6, homophily: float = 0.8,
                        feature_signal: float = 0.3, num_features: int = 600, words_per_node: int = 18,
                        mean_degree: float = 4.0, labels_per_class: int = 20, num_val: int = 500,
                        num_test: int = 1000, seed: int = 0) -> Dataset:
    """A stochastic-block-model graph with bag-of-words features and a Planetoid split (see the
    module docstring). Deterministic for a given ``seed``; TypeError/ValueError naming a bad argument."""
    num_nodes = _checks.integer(num_nodes, "num_nodes", 2)
    num_classes = _checks.integer(num_classes, "num_classes", 2)
    num_features = _checks.integer(num_features, "num_features", num_classes)
    words_per_node = _checks.integer(words_per_node, "words_per_node", 1)
    labels_per_class = _checks.integer(labels_per_class, "labels_per_class", 1)
    num_val = _checks.integer(num_val, "num_val", 0)
    num_test = _checks.integer(num_test, "num_test", 1)
    seed = _checks.integer(seed, "seed", 0)
    homophily = _fraction(homophily, "homophily")
    feature_signal = _fraction(feature_signal, "feature_signal")
    mean_degree = _checks.positive_float(mean_degree, "mean_degree")
    if num_nodes < num_classes * (labels_per_class + 1):
        raise ValueError(f"num_nodes must be >= num_classes * (labels_per_class + 1) = "
                         f"{num_classes * (labels_per_class + 1)}, got {num_nodes}")
    if num_classes * labels_per_class + num_val + num_test > num_nodes:
        raise ValueError(f"num_val + num_test must leave room in num_nodes={num_nodes} after "
                         f"{num_classes * labels_per_class} labelled nodes, got {num_val} + {num_test}")
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(num_nodes) % num_classes).astype(np.int64)  # balanced classes
    edges = _block_model_edges(labels, num_classes, homophily, mean_degree, rng)
    features = _bag_of_words(labels, num_classes, num_features, words_per_node, feature_signal, rng)
    order = rng.permutation(num_nodes)
    train_idx = np.concatenate([order[labels[order] == c][:labels_per_class] for c in range(num_classes)])
    rest = order[~np.isin(order, train_idx)]
    name = f"sbm-h{homophily:g}-f{feature_signal:g}-s{seed}"
    return Dataset(name=name, features=features, labels=labels, train_idx=np.sort(train_idx),
                   val_idx=np.sort(rest[:num_val]), test_idx=np.sort(rest[num_val:num_val + num_test]),
                   num_classes=num_classes, edges=edges)


def _fraction(value, name: str) -> float:
    value = _checks.finite_float(value, name)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    return value


def _block_model_edges(labels: np.ndarray, num_classes: int, homophily: float, mean_degree: float,
                       rng: np.random.Generator) -> np.ndarray:
    num_nodes = len(labels)
    by_class = [np.flatnonzero(labels == c) for c in range(num_classes)]
    count = max(int(round(num_nodes * mean_degree / 2)), 1)
    source = rng.integers(0, num_nodes, count)
    same = rng.random(count) < homophily
    # The target's class: the source's own, or one of the others chosen uniformly.
    shift = rng.integers(1, num_classes, count)
    target_class = np.where(same, labels[source], (labels[source] + shift) % num_classes)
    sizes = np.array([len(members) for members in by_class])
    offset = np.floor(rng.random(count) * sizes[target_class]).astype(np.int64)
    members = np.concatenate(by_class)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    target = members[starts[target_class] + offset]
    pairs = np.sort(np.stack([source, target], axis=1), axis=1)
    return np.unique(pairs[pairs[:, 0] != pairs[:, 1]], axis=0).astype(np.int64)


def _bag_of_words(labels: np.ndarray, num_classes: int, num_features: int, words_per_node: int,
                  feature_signal: float, rng: np.random.Generator) -> np.ndarray:
    num_nodes = len(labels)
    block = num_features // num_classes
    from_class = rng.random((num_nodes, words_per_node)) < feature_signal
    class_words = labels[:, None] * block + rng.integers(0, block, (num_nodes, words_per_node))
    any_words = rng.integers(0, num_features, (num_nodes, words_per_node))
    words = np.where(from_class, class_words, any_words)
    features = np.zeros((num_nodes, num_features), dtype=np.float32)
    features[np.repeat(np.arange(num_nodes), words_per_node), words.ravel()] = 1.0
    return features


def edge_homophily(data: Dataset) -> float:
    """The fraction of ``data``'s edges whose two ends share a label (edges to unlabelled nodes skipped).

    Example: a generated graph has the homophily it was asked for::

        >>> graph = synthetic_planetoid(num_nodes=600, homophily=0.9, num_val=100, num_test=200, seed=0)
        >>> round(edge_homophily(graph), 1)
        0.9
    """
    if data.edges is None or not len(data.edges):
        raise ValueError("data must have edges")
    left, right = data.labels[data.edges[:, 0]], data.labels[data.edges[:, 1]]
    known = (left >= 0) & (right >= 0)
    return float(np.mean(left[known] == right[known]))


def save_planetoid(data: Dataset, output: str | os.PathLike) -> Path:
    """Write ``data`` (with edges) as the Planetoid ``.npz`` that :func:`carlskit.data.load_planetoid`
    reads, atomically; returns the path."""
    from carlskit._serialization import atomic_write, filesystem

    if not isinstance(data, Dataset):
        raise TypeError(f"data must be a Dataset, got {type(data).__name__}")
    if data.edges is None:
        raise ValueError("data must have edges (a graph) to be saved in the Planetoid format")
    buffer = io.BytesIO()
    np.savez_compressed(buffer, features=data.features.astype(np.float32), labels=data.labels.astype(np.int64),
                        edges=data.edges.astype(np.int64), train_idx=data.train_idx.astype(np.int64),
                        val_idx=data.val_idx.astype(np.int64), test_idx=data.test_idx.astype(np.int64))
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    fs, path = filesystem(output)
    atomic_write(fs, path, buffer.getvalue())
    return Path(output)
