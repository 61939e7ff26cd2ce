"""Synthetic Planetoid-format graphs: the knobs do what they say, the file loads, bad arguments are named."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from carlskit.data import edge_homophily, load_planetoid, save_planetoid, synthetic_planetoid

SMALL = {"num_nodes": 600, "num_classes": 4, "num_features": 200, "num_val": 100, "num_test": 200}


def _centroid_accuracy(data) -> float:
    """Nearest class centroid of the labelled nodes' (row-normalised) features, on the test nodes."""
    x = data.features / np.maximum(data.features.sum(axis=1, keepdims=True), 1.0)
    train = data.labels[data.train_idx]
    centroids = np.stack([x[data.train_idx][train == c].mean(axis=0) for c in range(data.num_classes)])
    return float(np.mean(np.argmax(x[data.test_idx] @ centroids.T, axis=1) == data.labels[data.test_idx]))


@pytest.mark.parametrize("homophily", [0.6, 0.9])
def test_measured_edge_homophily_is_close_to_the_knob(homophily):
    data = synthetic_planetoid(homophily=homophily, mean_degree=6.0, **SMALL)
    assert abs(edge_homophily(data) - homophily) < 0.04, edge_homophily(data)
    assert data.edges.shape[1] == 2 and (data.edges[:, 0] < data.edges[:, 1]).all()
    assert len(np.unique(data.edges, axis=0)) == len(data.edges)


def test_features_say_more_about_the_class_as_the_signal_rises():
    accuracy = [np.mean([_centroid_accuracy(synthetic_planetoid(feature_signal=f, seed=s, **SMALL))
                         for s in range(2)]) for f in (0.0, 0.2, 0.5)]
    assert accuracy[0] < 0.4, "no signal: near chance (1/4)"
    assert accuracy[0] + 0.1 < accuracy[1] and accuracy[1] + 0.1 < accuracy[2], accuracy
    assert accuracy[2] > 0.85


def test_planetoid_split_and_determinism():
    data = synthetic_planetoid(labels_per_class=7, seed=3, **SMALL)
    assert np.bincount(data.labels[data.train_idx]).tolist() == [7] * 4
    assert len(data.val_idx) == 100 and len(data.test_idx) == 200
    splits = np.concatenate([data.train_idx, data.val_idx, data.test_idx])
    assert len(np.unique(splits)) == len(splits), "train, validation and test are disjoint"
    again = synthetic_planetoid(labels_per_class=7, seed=3, **SMALL)
    other = synthetic_planetoid(labels_per_class=7, seed=4, **SMALL)
    for name in ("features", "labels", "edges", "train_idx", "val_idx", "test_idx"):
        np.testing.assert_array_equal(getattr(data, name), getattr(again, name))
    assert not np.array_equal(data.edges, other.edges[:len(data.edges)])


def test_saved_file_loads_as_a_planetoid_graph(tmp_path):
    data = synthetic_planetoid(seed=1, **SMALL)
    path = save_planetoid(data, tmp_path / "sub" / "graph.npz")
    loaded = load_planetoid(path)
    assert loaded.name == "graph" and loaded.num_classes == 4
    for name in ("features", "labels", "edges", "train_idx", "val_idx", "test_idx"):
        np.testing.assert_array_equal(getattr(loaded, name), getattr(data, name))


def test_command_writes_a_graph(tmp_path):
    out = subprocess.run([sys.executable, "-m", "carlskit.data", "synthetic", str(tmp_path / "g.npz"), "--nodes",
                          "300", "--classes", "3", "--features", "60", "--homophily", "0.7",
                          "--val", "50", "--test", "100", "--seed", "2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert load_planetoid(tmp_path / "g.npz").num_items == 300


@pytest.mark.parametrize("argument, value, error", [
    ("homophily", 1.5, ValueError), ("homophily", "high", TypeError), ("feature_signal", -0.1, ValueError),
    ("num_classes", 1, ValueError), ("num_nodes", 2.5, TypeError), ("mean_degree", 0.0, ValueError),
    ("labels_per_class", 0, ValueError), ("num_test", 10_000, ValueError), ("seed", True, TypeError)])
def test_bad_arguments_are_named(argument, value, error):
    with pytest.raises(error, match=argument if argument != "num_test" else "num_val \\+ num_test"):
        synthetic_planetoid(**{**SMALL, argument: value})


def test_save_needs_a_graph(tmp_path):
    with pytest.raises(TypeError, match="data must be a Dataset"):
        save_planetoid({"features": 1}, tmp_path / "x.npz")
    from dataclasses import replace

    with pytest.raises(ValueError, match="data must have edges"):
        save_planetoid(replace(synthetic_planetoid(**SMALL), edges=None), tmp_path / "x.npz")
    assert not (tmp_path / "x.npz").exists()
