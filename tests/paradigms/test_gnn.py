"""The bank-served GNN (CARLS figure 3): reference propagation, staleness control, accuracy at tiny size."""

import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from carlskit.bank import KnowledgeBank
from carlskit.data import synthetic_planetoid
from carlskit.makers import MakerContext, NeighborMaker
from carlskit.paradigms import gnn
from carlskit.training import CheckpointStore, NeighborKnowledge


def test_full_graph_propagation_matches_a_hand_computed_path_graph():
    # Path 0 - 1 - 2 (given twice and with a self-loop, which must not count): z = D~^-1 (A + I) h.
    senders, receivers = gnn.symmetric_edges(np.array([[0, 1], [1, 2], [2, 1], [1, 1]]), 3)
    h = jnp.array([[1.0, 0.0], [2.0, 3.0], [4.0, 6.0]])
    z = np.asarray(gnn.propagate(h, jnp.asarray(senders), jnp.asarray(receivers)))
    expected = np.array([[(1 + 2) / 2, (0 + 3) / 2], [(2 + 1 + 4) / 3, (3 + 0 + 6) / 3], [(4 + 2) / 2, (6 + 3) / 2]])
    np.testing.assert_allclose(z, expected, rtol=1e-6)
    # The bank-served aggregation over fixed-width records (-1 padding, weight 0) computes the same.
    ids = np.array([[1, -1], [0, 2], [1, -1]])
    weights = (ids >= 0).astype(np.float32)
    served = gnn.aggregate(h, h[np.maximum(ids, 0)], jnp.asarray(weights))
    np.testing.assert_allclose(np.asarray(served), expected, rtol=1e-6)


def test_aggregate_names_the_shapes_it_expects():
    with pytest.raises(ValueError, match=r"neighbor_embeddings \[B, K, D\].*\(3, 2\), \(3, 4, 5\)"):
        gnn.aggregate(jnp.zeros((3, 2)), jnp.zeros((3, 4, 5)), jnp.zeros((3, 4)))


def test_symmetric_edges_rejects_bad_shapes_and_ids():
    with pytest.raises(ValueError, match=r"edges must have shape \[M, 2\]"):
        gnn.symmetric_edges(np.zeros((3, 3), np.int64), 5)
    with pytest.raises(ValueError, match=r"node ids in \[0, 5\)"):
        gnn.symmetric_edges(np.array([[0, 7]]), 5)


def _bank_with_versions(tmp_path, versions_written):
    """A bank whose 'hidden' rows 0..3 were written at the given model versions, a path-graph record
    table, and a checkpoint store holding versions 0, 5, 10 of a real GNN."""
    data = synthetic_planetoid(num_nodes=60, num_classes=2, labels_per_class=5, num_val=10, num_test=20, seed=0)
    features = gnn._features(data)
    make_model = lambda: gnn.GNN(data.num_features, 4, 2, dropout=0.0, seed=0)  # noqa: E731
    store = CheckpointStore(str(tmp_path / "ckpt"), keep=None)
    from flax import nnx

    for version in (0, 5, 10):
        store.save({"model": nnx.state(make_model())}, version=version)
    bank = KnowledgeBank()
    bank.create_table("hidden", dim=4, initializer="zeros")
    bank.create_feature_table("nbrs", schema={"ids": ("int64", 2), "weights": ("float32", 2)})
    items = np.arange(4, dtype=np.int64)
    bank.update("nbrs", items, {"ids": np.array([[1, -1], [0, 2], [1, 3], [2, -1]]),
                                "weights": np.array([[1, 0], [1, 1], [1, 1], [1, 0]], np.float32)}, version=0)
    for item, version in enumerate(versions_written):
        bank.update("hidden", np.array([item]), np.full((1, 4), float(version), np.float32), version=version)
    return bank, store, make_model, features


def test_staleness_guard_reencodes_neighbours_beyond_max_staleness(tmp_path):
    bank, store, make_model, features = _bank_with_versions(tmp_path, [0, 5, 10, 10])
    encoder = gnn.CheckpointEncoder(make_model, gnn.encode_hidden, features, store)
    guard = gnn.StalenessGuard(NeighborKnowledge(bank, max_neighbors=2, embeddings_table="hidden"), store,
                               max_staleness=1, on_stale="reencode", reencode=encoder)
    out = guard({"ids": np.array([1, 2])})
    # Node 1 reads 0 (version 0: 2 checkpoints behind, re-encoded from version 10) and 2 (version 10);
    # the oldest left is node 2's neighbour 1 (version 5, one behind: allowed).
    assert out["_staleness_read"] == 2.0 and out["_staleness_versions"] == 1.0 and out["_reencoded"] == 1
    fresh = encoder(np.array([0]), 10)[0]
    np.testing.assert_allclose(out["neighbor_embeddings"][0, 0], fresh, rtol=1e-6)
    np.testing.assert_allclose(out["neighbor_embeddings"][0, 1], np.full(4, 10.0))
    # Node 2 reads 1 (version 5: one behind, allowed) and 3: served from the bank unchanged.
    np.testing.assert_allclose(out["neighbor_embeddings"][1], [np.full(4, 5.0), np.full(4, 10.0)])


def test_staleness_guard_waits_for_the_maker_then_times_out(tmp_path):
    bank, store, _, _ = _bank_with_versions(tmp_path, [0, 10, 10, 10])
    knowledge = NeighborKnowledge(bank, max_neighbors=2, embeddings_table="hidden")
    guard = gnn.StalenessGuard(knowledge, store, max_staleness=1, on_stale="wait", timeout_seconds=0.2)
    assert guard({"ids": np.array([2, 3])})["_staleness_versions"] == 0.0  # fresh neighbours: no wait
    with pytest.raises(TimeoutError, match="max_staleness=1"):
        guard({"ids": np.array([1])})  # neighbour 0 is 2 versions behind and no maker runs
    with pytest.raises(ValueError, match="on_stale must be 'wait' or 'reencode'"):
        gnn.StalenessGuard(knowledge, store, max_staleness=1, on_stale="skip")
    with pytest.raises(TypeError, match="needs reencode"):
        gnn.StalenessGuard(knowledge, store, max_staleness=1, on_stale="reencode")


def test_neighbor_maker_mixes_the_given_graph_with_the_nearest_by_weight():
    bank = KnowledgeBank()
    bank.create_table("hidden", dim=2)
    bank.create_feature_table("nbrs", schema={"ids": ("int64", 3), "weights": ("float32", 3)})
    items = np.arange(4, dtype=np.int64)
    bank.update("hidden", items, np.array([[1, 0], [0.9, 0.1], [0, 1], [0.1, 0.9]], np.float32), version=0)
    given_ids = np.array([[2, 3], [3, -1], [0, -1], [1, -1]])
    maker = NeighborMaker(1, table="hidden", given_ids=given_ids, given_weights=(given_ids >= 0).astype(np.float32),
                          mix=0.25)
    maker(MakerContext(items=items, version=3, checkpoint={}, metadata={}, bank=bank, slice_index=0))
    records, _ = bank.lookup("nbrs", items)
    np.testing.assert_array_equal(records["ids"], [[2, 3, 1], [3, -1, 0], [0, -1, 3], [1, -1, 2]])
    np.testing.assert_allclose(records["weights"], [[0.75, 0.75, 0.25], [0.75, 0, 0.25], [0.75, 0, 0.25],
                                                    [0.75, 0, 0.25]])
    with pytest.raises(ValueError, match="mix must be in"):
        NeighborMaker(1, given_ids=given_ids, given_weights=given_ids * 1.0, mix=2.0)


def test_bank_served_gnn_beats_the_mlp_at_tiny_size():
    # Words say little about the class (feature_signal 0.1), the graph much (homophily 0.9): the
    # neighbours' bank embeddings must carry the difference. A no-op aggregation fails this.
    data = synthetic_planetoid(num_nodes=400, num_classes=3, homophily=0.9, feature_signal=0.1, num_features=90,
                               words_per_node=10, mean_degree=6, labels_per_class=10, num_val=100, num_test=200,
                               seed=1)
    config = gnn.GNNConfig(steps=40, hidden=16, neighbors=16, batch_size=100, checkpoint_every=5,
                           max_staleness=1)
    base = gnn.train_full_graph(data, config, seed=0, use_graph=False)
    served = gnn.train_bank_gnn(data, config, seed=0)
    assert served["test_acc"] >= base["test_acc"] + 0.10, (served["test_acc"], base["test_acc"])
    assert served["maker_status"][0]["errors"] == []
    assert 0 <= served["max_staleness_versions"] <= 1  # the guard held
    assert all("staleness_versions" in r and "in_batch_neighbors" in r for r in served["history"])


def test_command_line_help_names_the_staleness_options():
    out = subprocess.run([sys.executable, "-m", "carlskit.paradigms.gnn", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "--max-staleness" in out.stdout and "--on-stale" in out.stdout
