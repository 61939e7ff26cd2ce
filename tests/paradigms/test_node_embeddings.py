"""Node embeddings through the bank: at tiny size, skip-gram on random walks beats the same pipeline
with untrained (initializer) embeddings, and the walks and pairs follow DeepWalk's definition."""

from dataclasses import replace

import numpy as np

from carlskit.bank import KnowledgeBank
from carlskit.data import synthetic_planetoid
from carlskit.paradigms import node_embeddings as ne

TINY = replace(ne.NodeEmbeddingConfig(), dim=16, walks_per_node=4, walk_length=10, window=3, batch_size=512)


def _graph():
    return synthetic_planetoid(num_nodes=400, num_classes=4, homophily=0.9, mean_degree=6.0, labels_per_class=10,
                               num_val=100, num_test=200, seed=0)


def test_walks_follow_edges_and_pairs_stay_within_the_window():
    data = _graph()
    indptr, neighbors = ne.adjacency(data.edges, data.num_items)
    rng = np.random.default_rng(0)
    walks = ne.random_walks(indptr, neighbors, np.arange(data.num_items), 6, rng)
    edges = {tuple(e) for e in data.edges} | {tuple(e[::-1]) for e in data.edges}
    steps = {(a, b) for walk in walks for a, b in zip(walk[:-1], walk[1:]) if a != b}
    assert steps <= edges
    pairs = ne.skip_gram_pairs(walks[:, :4], window=2, rng=rng)
    assert len(pairs) <= 2 * (3 + 2) * len(walks)  # offsets 1 and 2 of 4-node walks, both directions


def test_skip_gram_through_the_bank_beats_untrained_embeddings():
    data = _graph()
    trained = ne.train(data, TINY, seed=0, steps=60)
    bank = KnowledgeBank()  # the baseline: the tables' initial values, never trained
    ne.create_tables(bank, TINY, data.num_items, seed=0)
    untrained = ne.evaluate(bank.lookup("nodes", np.arange(data.num_items), insert_missing=True)[0], data)
    assert trained["rows"] == {"nodes": data.num_items, "contexts": data.num_items}
    assert np.mean(trained["losses"][0][-10:]) < 0.7 * np.mean(trained["losses"][0][:5])
    assert trained["test_acc"] > untrained["test_acc"] + 0.3, (trained["test_acc"], untrained["test_acc"])
    assert trained["test_acc"] > 0.6  # 4 classes: chance is 0.25


def test_few_pairs_per_node_learn_with_a_larger_learning_rate_and_not_with_the_default():
    # The million-node run's regime: one walk of 10 per node (about 46 pairs per node, Cora gets
    # about 2,400). Starting near zero (context rows 0, node rows +-0.5/dim), a row pair grows by
    # about (1 + lr / sqrt(0.1) / 2) per use: at the default 0.05 it has not left zero after 46
    # uses (chance), at 0.2 it has (module docstring).
    data = synthetic_planetoid(num_nodes=3000, num_classes=6, homophily=0.8, mean_degree=8.0, num_features=12,
                               words_per_node=1, num_val=300, num_test=600, seed=0)
    few = replace(ne.NodeEmbeddingConfig(), dim=32, walks_per_node=1, walk_length=10, batch_size=1024)
    default = ne.train(data, few, seed=0)
    larger = ne.train(data, replace(few, learning_rate=0.2), seed=0)
    assert default["samples"] / data.num_items < 50  # the regime: under 50 pairs per node
    assert default["test_acc"] < 0.35 and larger["test_acc"] > 0.7, (default["test_acc"], larger["test_acc"])


def test_the_tables_use_the_configured_optimizer_and_plain_sgd_learns():
    # `optimizer="sgd"`: the plain SGD baseline (benchmarks/lazy_vs_immediate.py --optimizer sgd)
    data = _graph()
    sgd = replace(TINY, optimizer="sgd", learning_rate=0.1)  # 0.05 learns slowly here, 1.0 diverges
    bank = KnowledgeBank()
    ne.create_tables(bank, sgd, data.num_items, seed=0)
    assert {bank.tables[t]["optimizer"] for t in ("nodes", "contexts")} == {"sgd"}
    ne.create_tables(adagrad := KnowledgeBank(), TINY, data.num_items, seed=0)
    assert adagrad.tables["nodes"]["optimizer"] == "adagrad"
    trained = ne.train(data, sgd, seed=0, steps=60)
    assert np.mean(trained["losses"][0][-10:]) < 0.8 * np.mean(trained["losses"][0][:5])
    assert trained["test_acc"] > 0.6, trained["test_acc"]  # 4 classes: chance is 0.25
