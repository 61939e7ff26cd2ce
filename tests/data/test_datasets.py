import numpy as np
import pytest

from carlskit.data import load_digits, load_planetoid, neighbors_from_edges, planetoid_path


def test_digits_splits_are_disjoint_and_labelled_fraction_holds():
    data = load_digits(0.05, seed=3)
    assert data.features.shape == (1797, 64) and data.features.max() <= 1.0
    splits = [set(data.train_idx), set(data.val_idx), set(data.test_idx)]
    assert not (splits[0] & splits[1]) and not (splits[0] & splits[2]) and not (splits[1] & splits[2])
    assert set(data.labels[data.train_idx]) == set(range(10)), "every class keeps a label"
    pool = 1797 - len(data.val_idx) - len(data.test_idx)
    assert abs(len(data.train_idx) - 0.05 * pool) <= 1
    with pytest.raises(ValueError, match="label_fraction"):
        load_digits(0.0)


def _write_graph(path, **overrides):
    arrays = dict(features=np.eye(4, dtype=np.float32), labels=np.array([0, 1, 1, -1]),
                  edges=np.array([[0, 1], [1, 2]]), train_idx=np.array([0, 1]), val_idx=np.array([2]),
                  test_idx=np.array([3]))
    arrays.update(overrides)
    np.savez(path, **{k: v for k, v in arrays.items() if v is not None})


def test_planetoid_loader_accepts_any_graph_in_the_format(tmp_path):
    _write_graph(tmp_path / "tiny.npz")
    data = load_planetoid(tmp_path / "tiny.npz")
    assert data.num_items == 4 and data.num_classes == 2 and data.edges.shape == (2, 2)


@pytest.mark.parametrize("override, message", [
    (dict(edges=None), "missing array 'edges'"),
    (dict(labels=np.zeros(4, np.float32)), "labels"),
    (dict(edges=np.array([[0, 9]])), "edges holds ids outside"),
    (dict(labels=np.array([0, 1])), r"labels must have shape \(4,\)"),
])
def test_planetoid_loader_names_the_bad_array(tmp_path, override, message):
    _write_graph(tmp_path / "bad.npz", **override)
    with pytest.raises(ValueError, match=message):
        load_planetoid(tmp_path / "bad.npz")


def test_cora_matches_its_readme():
    path = planetoid_path("cora")
    if path is None:
        pytest.skip("shared/data/planetoid/cora.npz is not present on this machine")
    data = load_planetoid(path)
    assert (data.num_items, data.num_features, data.num_classes) == (2708, 1433, 7)
    assert len(data.train_idx) == 140 and len(data.edges) == 5278


def test_neighbor_records_are_symmetric_padded_and_capped():
    edges = np.array([[0, 1], [0, 2], [0, 3], [1, 2]])
    ids, weights = neighbors_from_edges(edges, 5, max_neighbors=2, seed=0)
    assert ids.shape == (5, 2) and weights.dtype == np.float32
    assert set(ids[1]) == {0, 2} and set(ids[3]) == {0, -1}
    assert len(set(ids[0])) == 2 and set(ids[0]) <= {1, 2, 3}
    assert (ids[4] == -1).all() and (weights[4] == 0).all()
    np.testing.assert_array_equal(weights, (ids >= 0).astype(np.float32))
