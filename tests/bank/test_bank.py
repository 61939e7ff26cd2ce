"""KnowledgeBank in-process: every operation, the lazy rule end to end, nearest, snapshots, errors."""

import hashlib
import json
import uuid

import fsspec
import numpy as np
import pytest

from carlskit._errors import CorruptFileError
from carlskit._serialization import dumps_checked_json, loads_checked_json
from carlskit.bank import KnowledgeBank, key_from_string

DIM = 8


def make_bank(clock=None, num_shards=3, **table_kwargs):
    kb = KnowledgeBank(num_shards=num_shards, clock=clock)
    kb.create_table("emb", dim=DIM, seed=7, **table_kwargs)
    return kb


def test_initial_values_deterministic_across_shards_and_banks():
    keys = np.arange(1, 2001) * 7919
    values = [make_bank(num_shards=s).lookup("emb", keys, insert_missing=True)[0] for s in (1, 2, 5)]
    np.testing.assert_array_equal(values[0], values[1])
    np.testing.assert_array_equal(values[0], values[2])
    assert abs(values[0].mean()) < 0.01 and abs(values[0].std() - 1 / np.sqrt(DIM)) < 0.01
    other_seed = KnowledgeBank()
    other_seed.create_table("emb", dim=DIM, seed=8)
    assert not np.allclose(other_seed.lookup("emb", keys, insert_missing=True)[0], values[0])


@pytest.mark.parametrize("initializer", ["zeros", "uniform"])
def test_other_initializers(initializer):
    kb = KnowledgeBank()
    kb.create_table("emb", dim=4, initializer=initializer, init_scale=0.5)
    values, _ = kb.lookup("emb", np.arange(1000), insert_missing=True)
    if initializer == "zeros":
        assert (values == 0).all()
    else:
        assert values.min() >= -0.5 and values.max() <= 0.5 and values.std() > 0.2


def test_lookup_insert_missing_and_found():
    kb = make_bank()
    values, found = kb.lookup("emb", [5, 6])
    assert not found.any() and (values == 0).all()
    assert kb.stats()["tables"]["emb"]["rows"] == 0
    inserted, found = kb.lookup("emb", [5, 6, 5], insert_missing=True)
    assert not found.any()
    np.testing.assert_array_equal(inserted[0], inserted[2])
    again, found = kb.lookup("emb", [6, 5, 9])
    np.testing.assert_array_equal(found, [True, True, False])
    np.testing.assert_array_equal(again[:2], inserted[[1, 0]])
    assert kb.stats()["tables"]["emb"]["rows"] == 2


def test_update_version_metadata_and_lookup_counts(clock):
    kb = make_bank(clock)
    keys = np.array([10, 20, 30])
    kb.update("emb", keys, np.ones((3, DIM)), version=4)
    clock.now = 1005.0
    kb.update("emb", [20, 20], np.stack([np.full(DIM, 2.0), np.full(DIM, 3.0)]), version=5)
    values, found = kb.lookup("emb", keys)
    assert found.all()
    np.testing.assert_array_equal(values[:, 0], [1, 3, 1])  # later duplicate wins
    kb.lookup("emb", [10])
    meta = kb.row_metadata("emb", [10, 20, 30, 99])
    np.testing.assert_array_equal(meta["found"], [True, True, True, False])
    np.testing.assert_array_equal(meta["version"], [4, 5, 4, -1])
    np.testing.assert_array_equal(meta["last_write_time"][:3], [1000, 1005, 1000])
    assert np.isnan(meta["last_write_time"][3])
    np.testing.assert_array_equal(meta["lookup_count"], [2, 1, 1, 0])
    stats = kb.stats()["tables"]["emb"]
    assert (stats["min_version"], stats["max_version"]) == (4, 5)
    assert stats["rows_updated"] == 4 and stats["rows_looked_up"] == 4
    assert 2 <= stats["update_shard_calls"] <= 4  # one call per shard touched by a batch


def test_lazy_average_applied_on_lookup():
    kb = make_bank(learning_rate=0.5, initializer="zeros")
    kb.apply_gradients("emb", [1, 2, 1], np.array([[2.0] * DIM, [4.0] * DIM, [6.0] * DIM]))
    kb.apply_gradients("emb", [1], np.full((1, DIM), 10.0))
    assert kb.stats()["tables"]["emb"]["pending_gradients"] == 4
    values, found = kb.lookup("emb", [1, 2])
    # key 1: mean(2, 6, 10) = 6 -> 0 - 0.5 * 6; key 2: -0.5 * 4
    np.testing.assert_allclose(values[:, 0], [-3.0, -2.0])
    stats = kb.stats()["tables"]["emb"]
    assert stats["pending_gradients"] == 0 and stats["gradients_applied"] == 4
    assert stats["optimizer_steps"] == 2


def test_nan_gradients_dropped_and_counted():
    kb = make_bank(learning_rate=1.0, initializer="zeros")
    grads = np.ones((3, DIM))
    grads[1, 3] = np.nan
    grads[2, 0] = np.inf
    kb.apply_gradients("emb", [4, 4, 4], grads)
    values, _ = kb.lookup("emb", [4])
    np.testing.assert_allclose(values, -np.ones((1, DIM)))
    assert kb.stats()["tables"]["emb"]["dropped_nonfinite"] == 2


def test_outlier_gradient_dropped():
    kb = make_bank(learning_rate=1.0, initializer="zeros")
    scale = np.array([1.0, 1.0, 1.0, 1.2, 50.0])[:, None]  # norms x sqrt(DIM); MAD 0, median 1
    kb.apply_gradients("emb", [3] * 5, scale * np.ones((5, DIM)))
    values, _ = kb.lookup("emb", [3])
    # median 1, MAD 0 -> everything above the median norm is an outlier: 1.2 and 50 dropped
    np.testing.assert_allclose(values, -np.ones((1, DIM)))
    assert kb.stats()["tables"]["emb"]["dropped_outliers"] == 2


def test_max_pending_flush():
    kb = make_bank(learning_rate=1.0, initializer="zeros", max_pending=3)
    kb.apply_gradients("emb", [8, 8], np.array([[1.0] * DIM, [2.0] * DIM]))
    assert kb.stats()["tables"]["emb"]["pending_gradients"] == 2
    kb.apply_gradients("emb", [8, 9], np.array([[3.0] * DIM, [1.0] * DIM]))  # key 8 reaches 3
    stats = kb.stats()["tables"]["emb"]
    assert stats["pending_gradients"] == 1 and stats["optimizer_steps"] == 1
    assert kb.row_metadata("emb", [8])["lookup_count"][0] == 0  # applied without a lookup
    values, _ = kb.lookup("emb", [8])
    np.testing.assert_allclose(values, -2.0 * np.ones((1, DIM)))  # mean(1, 2, 3)


def test_ttl_flush(clock):
    kb = make_bank(clock, learning_rate=1.0, initializer="zeros", pending_ttl_seconds=10.0)
    kb.apply_gradients("emb", [1], np.ones((1, DIM)))
    clock.now += 5
    kb.apply_gradients("emb", [1, 2], np.array([[3.0] * DIM, [5.0] * DIM]))
    clock.now += 5  # oldest gradient of key 1 is exactly 10 s old: not yet older than the ttl
    assert kb.stats()["tables"]["emb"]["pending_gradients"] == 3
    clock.now += 0.5
    stats = kb.stats()["tables"]["emb"]
    assert stats["pending_gradients"] == 1 and stats["optimizer_steps"] == 1  # key 1 flushed
    meta = kb.row_metadata("emb", [1])
    assert meta["last_write_time"][0] == clock.now and meta["lookup_count"][0] == 0
    clock.now += 5
    assert kb.stats()["tables"]["emb"]["pending_gradients"] == 0  # key 2 flushed too
    values, _ = kb.lookup("emb", [1, 2])
    np.testing.assert_allclose(values[:, 0], [-2.0, -5.0])


def test_adagrad_hand_computed():
    kb = make_bank(optimizer="adagrad", learning_rate=0.1, initial_accumulator_value=0.5,
                   initializer="zeros")
    kb.apply_gradients("emb", [1, 1], np.array([[1.0] * DIM, [3.0] * DIM]))
    first, _ = kb.lookup("emb", [1])
    acc = 0.5 + 2.0 ** 2
    expected = -0.1 * 2.0 / np.sqrt(acc + 1e-7)
    np.testing.assert_allclose(first, np.full((1, DIM), expected), rtol=1e-6)
    kb.apply_gradients("emb", [1], np.full((1, DIM), -1.0))
    second, _ = kb.lookup("emb", [1])
    acc += 1.0
    np.testing.assert_allclose(second, np.full((1, DIM), expected + 0.1 / np.sqrt(acc + 1e-7)),
                               rtol=1e-6)


def test_update_discards_pending_gradients():
    kb = make_bank(initializer="zeros")
    kb.apply_gradients("emb", [1, 2], np.ones((2, DIM)))
    kb.update("emb", [1], np.full((1, DIM), 7.0), version=1)
    values, _ = kb.lookup("emb", [1, 2])
    np.testing.assert_allclose(values[:, 0], [7.0, -0.1])
    assert kb.stats()["tables"]["emb"]["discarded_by_update"] == 1


def test_many_pending_gradients_survive_compaction():
    """Thousands of pending entries, partial flushes and buffer compaction lose nothing."""
    kb = make_bank(initializer="zeros", learning_rate=1.0, max_pending=10_000,
                   outlier_threshold=1e9)
    rng = np.random.default_rng(0)
    num_keys = 500
    pending = [[] for _ in range(num_keys)]
    expected = np.zeros(num_keys)

    def apply_expected(indices):
        for i in indices:
            if pending[i]:
                expected[i] -= np.mean(pending[i])
                pending[i] = []

    for step in range(30):
        keys = rng.integers(0, num_keys, 300)
        grads = rng.normal(size=300)
        for key, grad in zip(keys, grads):
            pending[key].append(np.float32(grad))
        kb.apply_gradients("emb", keys + 1, np.repeat(grads[:, None], DIM, 1))
        if step % 7 == 6:
            subset = np.arange(step % 3, num_keys, 3)
            kb.lookup("emb", subset + 1)
            apply_expected(subset)
    stats = kb.stats()["tables"]["emb"]
    assert stats["pending_gradients"] == sum(len(p) for p in pending)
    assert stats["gradients_received"] == 30 * 300
    kb.flush("emb")
    apply_expected(range(num_keys))
    stats = kb.stats()["tables"]["emb"]
    assert stats["pending_gradients"] == 0 and stats["gradients_applied"] == 30 * 300
    values, _ = kb.lookup("emb", np.arange(num_keys) + 1)
    np.testing.assert_allclose(values[:, 0], expected, rtol=1e-5, atol=1e-5)


def brute_force(values, keys, queries, k, metric):
    if metric == "dot":
        scores = queries @ values.T
    elif metric == "cosine":
        scores = (queries / np.linalg.norm(queries, axis=1, keepdims=True)) @ (
            values / np.linalg.norm(values, axis=1, keepdims=True)).T
    else:
        scores = ((queries[:, None, :] - values[None]) ** 2).sum(-1)
    order = np.argsort(-scores if metric != "l2" else scores, axis=1)[:, :k]
    return keys[order], np.take_along_axis(scores, order, 1)


@pytest.mark.parametrize("metric", ["dot", "cosine", "l2"])
def test_nearest_matches_brute_force_after_interleaved_writes(metric):
    rng = np.random.default_rng(1)
    kb = make_bank(num_shards=3, index="hnsw", index_metric=metric, learning_rate=0.5)
    all_keys = np.arange(100, 700)
    queries = rng.normal(size=(20, DIM)).astype(np.float32)
    kb.lookup("emb", all_keys[:300], insert_missing=True)
    kb.nearest("emb", queries, k=5, metric=metric)  # builds the approximate graph
    kb.update("emb", all_keys[250:450], rng.normal(size=(200, DIM)), version=1)  # overwrite + new
    kb.apply_gradients("emb", all_keys[:50], rng.normal(size=(50, DIM)))
    kb.lookup("emb", all_keys[:50])  # applies them
    kb.lookup("emb", all_keys[450:600], insert_missing=True)
    values, found = kb.lookup("emb", all_keys[:600])
    assert found.all()
    expected_keys, expected_scores = brute_force(values.astype(np.float64), all_keys[:600],
                                                 queries.astype(np.float64), 10, metric)
    for exact in (None, True):
        keys, scores = kb.nearest("emb", queries, k=10, metric=metric, exact=exact)
        assert keys.shape == (20, 10) and scores.dtype == np.float32
        if exact:  # same scores as brute force, and each key really has its score
            np.testing.assert_allclose(scores, expected_scores, rtol=1e-4, atol=1e-4)
            own = brute_force(values.astype(np.float64), all_keys[:600],
                              queries.astype(np.float64), 600, metric)
            lookup = [dict(zip(own[0][q], own[1][q])) for q in range(len(queries))]
            got = np.array([[lookup[q][key] for key in keys[q]] for q in range(len(queries))])
            np.testing.assert_allclose(got, scores, rtol=1e-4, atol=1e-4)
            assert (keys == expected_keys).mean() > 0.95
        else:  # HNSW with the stale rows re-searched exactly
            recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(keys, expected_keys)])
            assert recall >= 0.9


def test_nearest_exclude_and_padding():
    kb = make_bank(num_shards=2)
    keys = np.array([1, 2, 3])
    values, _ = kb.lookup("emb", keys, insert_missing=True)
    near, scores = kb.nearest("emb", values, k=2, metric="cosine", exclude=keys)
    assert not (near == keys[:, None]).any()
    near, scores = kb.nearest("emb", values[:1], k=5, metric="l2")
    assert near[0, 0] == 1 and (near[0, 3:] == -1).all() and np.isinf(scores[0, 3:]).all()


def test_hnsw_sees_overwritten_rows_without_rebuild():
    rng = np.random.default_rng(5)
    kb = make_bank(num_shards=2, index="hnsw", index_metric="l2")
    keys = np.arange(1, 3001)
    kb.update("emb", keys, rng.normal(size=(3000, DIM)), version=0)
    queries = rng.normal(size=(8, DIM)).astype(np.float32) * 10  # far from every stored row
    before, _ = kb.nearest("emb", queries, k=3, metric="l2")  # builds the graphs
    assert not np.isin(before, keys[:8]).any()
    kb.update("emb", keys[:8], queries, version=1)  # 8 of 3000 rows move onto the queries
    kb.update("emb", [5000], queries[:1] + 0.01, version=1)  # and a new row next to query 0
    near, scores = kb.nearest("emb", queries, k=3, metric="l2")
    np.testing.assert_array_equal(near[:, 0], keys[:8])
    np.testing.assert_allclose(scores[:, 0], 0, atol=1e-4)
    assert near[0, 1] == 5000
    exact, _ = kb.nearest("emb", queries, k=3, metric="l2", exact=True)
    np.testing.assert_array_equal(exact[:, :1], near[:, :1])


def test_nearest_exclude_several_keys_per_query():
    kb = make_bank(num_shards=2)
    values, _ = kb.lookup("emb", np.arange(1, 101), insert_missing=True)
    first, _ = kb.nearest("emb", values[:4], k=3, metric="cosine")
    excluded, _ = kb.nearest("emb", values[:4], k=3, metric="cosine", exclude=first[:, :2])
    np.testing.assert_array_equal(excluded[:, 0], first[:, 2])
    assert not (excluded[:, :, None] == first[:, None, :2]).any()


def test_sample_keys_exist_and_are_deterministic():
    kb = make_bank(num_shards=3)
    keys = np.arange(1000, 1300)
    kb.lookup("emb", keys, insert_missing=True)
    sample = kb.sample("emb", n=4096, seed=3)
    assert sample.shape == (4096,) and np.isin(sample, keys).all()
    assert len(np.unique(sample)) > 250  # covers (nearly) every row of every shard
    np.testing.assert_array_equal(sample, kb.sample("emb", n=4096, seed=3))
    assert not np.array_equal(sample, kb.sample("emb", n=4096, seed=4))


def test_feature_table_roundtrip():
    kb = KnowledgeBank(num_shards=2)
    kb.create_feature_table("nbrs", {"ids": ("int64", 3), "weights": ("float32", 3)})
    kb.update("nbrs", [7, 8], {"ids": [[1, 2, -1], [3, -1, -1]],
                               "weights": [[0.5, 0.5, 0], [1, 0, 0]]}, version=2)
    records, found = kb.lookup("nbrs", [8, 7, 9])
    np.testing.assert_array_equal(found, [True, True, False])
    np.testing.assert_array_equal(records["ids"], [[3, -1, -1], [1, 2, -1], [-1, -1, -1]])
    assert records["weights"].dtype == np.float32 and records["weights"][2].sum() == 0
    with pytest.raises(ValueError, match="embedding table"):
        kb.nearest("nbrs", np.zeros((1, 3)), k=1)


def test_string_keys():
    kb = make_bank()
    values, _ = kb.lookup("emb", ["apple", "pear"], insert_missing=True)
    again, found = kb.lookup("emb", key_from_string(["pear", "apple"]))
    assert found.all()
    np.testing.assert_array_equal(again, values[::-1])
    assert (key_from_string(["a", "b"]) >= 0).all()


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
@pytest.mark.parametrize("load_shards", [1, 4])
def test_save_load_roundtrip_any_shard_count(tmp_path, clock, optimizer, load_shards,
                                             bank_contents, assert_same_contents):
    kb = make_bank(clock, num_shards=2, optimizer=optimizer, max_pending=100)
    kb.create_feature_table("nbrs", {"ids": ("int64", 2), "odd__name": ("bool", 1)})
    keys = np.arange(1, 301)
    kb.lookup("emb", keys, insert_missing=True)
    kb.update("emb", keys[:100], np.full((100, DIM), 0.5), version=3)
    kb.apply_gradients("emb", keys[50:150], np.ones((100, DIM)))
    kb.lookup("emb", keys[50:80])  # applies some, leaves the rest pending
    clock.now += 1
    kb.apply_gradients("emb", keys[60:70], np.full((10, DIM), 2.0))
    kb.update("nbrs", [5], {"ids": [[1, 2]], "odd__name": [[True]]}, version=9)
    before = bank_contents(kb)
    kb.save(tmp_path / "a")
    restored = KnowledgeBank.load(tmp_path / "a", num_shards=load_shards, clock=clock)
    assert restored.num_shards == load_shards
    assert_same_contents(before, bank_contents(restored))
    stats = restored.stats()["tables"]["emb"]
    assert stats["pending_gradients"] == kb.stats()["tables"]["emb"]["pending_gradients"] > 0
    np.testing.assert_array_equal(restored.lookup("emb", keys)[0], kb.lookup("emb", keys)[0])
    meta_a, meta_b = kb.row_metadata("emb", keys), restored.row_metadata("emb", keys)
    for name in meta_a:
        np.testing.assert_array_equal(meta_a[name], meta_b[name])


def test_save_overwrites_atomically(tmp_path):
    kb = make_bank()
    kb.lookup("emb", [1, 2], insert_missing=True)
    kb.save(tmp_path / "snap")
    kb.lookup("emb", [3], insert_missing=True)
    kb.save(tmp_path / "snap")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snap"]  # no temporary left behind
    assert KnowledgeBank.load(tmp_path / "snap").stats()["tables"]["emb"]["rows"] == 3



def test_save_refuses_to_replace_what_is_not_a_snapshot(tmp_path):
    kb = make_bank()
    kb.lookup("emb", [1], insert_missing=True)
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "precious.txt").write_text("keep me")
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep me too")
    for path in (folder, a_file):
        with pytest.raises(ValueError, match="not a KnowledgeBank snapshot"):
            kb.save(path)
    assert (folder / "precious.txt").read_text() == "keep me"
    assert a_file.read_text() == "keep me too"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "results"]
    (tmp_path / "empty").mkdir()
    kb.save(tmp_path / "empty")  # an empty directory may be filled
    assert KnowledgeBank.load(tmp_path / "empty").stats()["tables"]["emb"]["rows"] == 1


def test_bank_rejects_a_clock_that_is_not_callable():
    with pytest.raises(TypeError, match="clock"):
        KnowledgeBank(clock="now")


def test_closed_bank_raises_instead_of_reading_freed_rows(tmp_path):
    kb = make_bank(num_shards=2)
    kb.update("emb", [1, 2], np.ones((2, DIM)))
    kb.close()
    for call in (lambda: kb.lookup("emb", [1]), lambda: kb.row_metadata("emb", [1]),
                 lambda: kb.update("emb", [1], np.ones((1, DIM))), lambda: kb.stats(),
                 lambda: kb.save(tmp_path / "snap"), lambda: kb.ping()):
        with pytest.raises(ValueError, match="closed"):
            call()
    assert not (tmp_path / "snap").exists()

BAD_CALLS = [
    ("create_table", ("emb",), {"dim": 4}, ValueError, "already exists"),
    ("create_table", ("new",), {"dim": 0}, ValueError, "dim"),
    ("create_table", ("new",), {"dim": 4, "initializer": "ones"}, ValueError, "initializer"),
    ("lookup", ("nope", [1]), {}, ValueError, "unknown table"),
    ("lookup", ("emb", [1, -1]), {}, ValueError, "-1"),
    ("lookup", ("emb", [[1, 2]]), {}, ValueError, r"shape \[n\]"),
    ("lookup", ("emb", [1.5]), {}, TypeError, "integer"),
    ("lookup", ("emb", [1, "a"]), {}, TypeError, "int 1 among strings"),
    ("update", ("emb", ["a", 2.5], np.ones((2, DIM))), {}, TypeError, "float 2.5 among strings"),
    ("lookup", ("emb", [True]), {}, TypeError, "bool"),
    ("lookup", ("emb", [[1], [2, 3]]), {}, ValueError, r"keys must be an array of shape \[n\]"),
    ("update", ("emb", [1, 2], [[0.0] * DIM, [0.0]]), {}, ValueError,
     rf"values must be an array of shape \[2, {DIM}\]"),
    ("lookup", ("emb", [1, 2]), {"insert_missing": "no"}, TypeError, "insert_missing"),
    ("lookup_async", ("emb", [1, 2]), {"insert_missing": 1}, TypeError, "insert_missing"),
    ("create_table", (5,), {"dim": 4}, TypeError, "name"),
    ("create_feature_table", ("new", {"a": (None, 2)}), {}, ValueError, "unknown dtype"),
    ("nearest", ("emb", np.ones((1, DIM))), {"exclude": np.array([2**64 - 1], np.uint64)},
     ValueError, "exclude"),
    ("update", ("emb", [1, 2], np.ones((2, DIM + 1))), {}, ValueError, rf"\[2, {DIM}\]"),
    ("update", ("emb", [1, 2], np.ones((3, DIM))), {}, ValueError, rf"\[2, {DIM}\]"),
    ("update", ("emb", [1, 2], np.ones(2 * DIM)), {}, ValueError, rf"\[2, {DIM}\]"),
    ("update", ("emb", [1, 2], np.array([[np.nan] * DIM, [0] * DIM])), {}, ValueError, "NaN"),
    ("update", ("emb", [1, 2], np.ones((2, DIM), bool)), {}, TypeError, "numeric"),
    ("update", ("emb", [5, -1], np.ones((2, DIM))), {}, ValueError, "-1"),
    ("update", ("emb", [1], np.ones((1, DIM))), {"version": 1.5}, TypeError, "version"),
    ("apply_gradients", ("emb", [1, 2], np.ones((1, DIM))), {}, ValueError, "gradients"),
    ("apply_gradients", ("nbrs", [1], np.ones((1, DIM))), {}, ValueError, "embedding"),
    ("update", ("nbrs", [1], {"ids": [[1.5, 2]]}), {}, TypeError, "ids"),
    ("update", ("nbrs", [1], {"other": [[1, 2]]}), {}, ValueError, "fields"),
    ("nearest", ("emb", np.ones(DIM)), {}, ValueError, "queries"),
    ("nearest", ("emb", np.ones((2, DIM))), {"metric": "hamming"}, ValueError, "metric"),
    ("nearest", ("emb", np.ones((2, DIM))), {"k": 0}, ValueError, "k"),
    ("nearest", ("emb", np.ones((2, DIM))), {"exclude": [1, 2, 3]}, ValueError, "exclude"),
    ("sample", ("emb",), {"n": -1}, ValueError, "n"),
    ("row_metadata", ("emb", [-1]), {}, ValueError, "-1"),
    ("update", ("emb", [1], np.ones((1, DIM))), {"version": -1}, ValueError, "version must be >= 0"),
    ("create_table", ("new",), {"dim": 4, "capacity": 2**62}, ValueError, "capacity must be <="),
    ("create_table", ("new",), {"dim": 2**40}, ValueError, "dim must be <="),
    ("create_feature_table", ("new", {"a": ("int8", 2**40)}), {}, ValueError, "width must be <="),
    ("nearest", ("emb", np.ones((2, DIM))), {"k": 2**40}, ValueError, "k must be <="),
    ("sample", ("emb",), {"n": 2**40}, ValueError, "n must be <="),
]


@pytest.mark.parametrize("method,args,kwargs,error,match", BAD_CALLS,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD_CALLS)])
def test_bad_input_raises_and_changes_nothing(clock, bank_contents, assert_same_contents, method,
                                             args, kwargs, error, match):
    kb = make_bank(clock, num_shards=2)
    kb.create_feature_table("nbrs", {"ids": ("int64", 2)})
    kb.lookup("emb", np.arange(1, 50), insert_missing=True)
    kb.apply_gradients("emb", [1, 2], np.ones((2, DIM)))
    before = bank_contents(kb)
    with pytest.raises(error, match=match):
        getattr(kb, method)(*args, **kwargs)
    assert_same_contents(before, bank_contents(kb))


@pytest.mark.parametrize("field,bad", [("small", [[1000, 0]]), ("small", [[0, -129]]),
                                       ("count", [[-1]]), ("ids", np.array([[2**63]], np.uint64))])
def test_integer_field_out_of_range_raises_instead_of_wrapping(bank_contents, assert_same_contents,
                                                               field, bad):
    kb = KnowledgeBank(num_shards=2)
    kb.create_feature_table("rec", {"small": ("int8", 2), "count": ("uint16", 1),
                                    "ids": ("int64", 1)})
    good = {"small": [[1, 2]], "count": [[3]], "ids": [[4]]}
    kb.update("rec", [7], good)
    before = bank_contents(kb)
    with pytest.raises(ValueError, match=rf"values\['{field}'\] has values outside the range"):
        kb.update("rec", [7], {**good, field: bad})
    assert_same_contents(before, bank_contents(kb))
    kb.update("rec", [7], {**good, "small": np.array([[-128, 127]], np.int64)})  # edges fit
    np.testing.assert_array_equal(kb.lookup("rec", [7])[0]["small"], [[-128, 127]])


def test_unsigned_feature_field_absent_value_is_its_largest_value():
    kb = KnowledgeBank(num_shards=2)
    kb.create_feature_table("rec", {"count": ("uint16", 2), "ids": ("int32", 1)})
    values, found = kb.lookup("rec", [5, 6], insert_missing=True)  # raised OverflowError mid-insert
    assert not found.any() and kb.stats()["tables"]["rec"]["rows"] == 2
    np.testing.assert_array_equal(values["count"], np.full((2, 2), 65535))
    np.testing.assert_array_equal(values["ids"], np.full((2, 1), -1))
    np.testing.assert_array_equal(kb.lookup("rec", [8])[0]["count"], [[65535, 65535]])


def test_async_calls_in_process_are_computed_at_once():
    kb = KnowledgeBank(num_shards=3)
    kb.create_table("emb", dim=4, learning_rate=1.0)
    keys = np.arange(1, 50)
    future = kb.apply_gradients_async("emb", keys, np.ones((49, 4)))
    assert future.done() and future.result() is None
    assert kb.stats()["tables"]["emb"]["pending_gradients"] == 49
    lookup = kb.lookup_async("emb", keys)
    assert lookup.done()
    values, found = lookup.result()
    expected = KnowledgeBank(num_shards=1)
    expected.create_table("emb", dim=4)
    np.testing.assert_allclose(values, expected.lookup("emb", keys, insert_missing=True)[0] - 1.0,
                               rtol=1e-6)
    assert found.all()
    empty_values, empty_found = kb.lookup("emb", np.empty(0, np.int64))
    assert empty_values.shape == (0, 4) and empty_found.shape == (0,)


def _manifest(snapshot):
    return json.loads((snapshot / "manifest.json").read_text())["content"]


def _sign(snapshot, content):
    (snapshot / "manifest.json").write_bytes(dumps_checked_json(content))


def _edit_manifest(change):
    """Change the manifest's content and re-sign it: the checks behind the checksum."""
    def edit(snapshot):
        content = _manifest(snapshot)
        change(content)
        _sign(snapshot, content)
    return edit


def _first_part(snapshot):
    return snapshot / _manifest(snapshot)["tables"][0]["parts"][0]["file"]


def _flip_byte(name_of):
    def edit(snapshot):
        path = name_of(snapshot)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    return edit


def _edit_part_column(column, change):
    """Change one column of shard 0's part and record the new SHA-256 in a re-signed manifest:
    a snapshot whose bytes are intact but whose content is wrong."""
    def edit(snapshot):
        content = _manifest(snapshot)
        part = content["tables"][0]["parts"][0]
        data = bytearray((snapshot / part["file"]).read_bytes())
        name, dtype, shape, offset = next(e for e in part["layout"] if e[0] == column)
        array = np.frombuffer(data, dtype=dtype, count=int(np.prod(shape)), offset=offset).copy()
        change(array)
        data[offset:offset + array.nbytes] = array.tobytes()
        (snapshot / part["file"]).write_bytes(bytes(data))
        part["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
        _sign(snapshot, content)
    return edit


def _write(name, content):
    return lambda snapshot: (snapshot / name).write_bytes(content)


MANIFEST, PART = "manifest.json", ".part"
CORRUPTIONS = {  # name: (edit, file named in the error, message)
    "manifest not json": (_write("manifest.json", b"{bad"), MANIFEST, "not valid JSON"),
    "manifest byte flipped": (_flip_byte(lambda s: s / "manifest.json"), MANIFEST, "SHA-256|JSON"),
    "manifest without checksum": (_write("manifest.json", b"[1, 2]"), MANIFEST, "checksummed"),
    "manifest a list": (lambda s: _sign(s, [1, 2]), MANIFEST, "not a KnowledgeBank snapshot"),
    "newer version": (_edit_manifest(lambda m: m.update(version=99)), MANIFEST, "format version 99"),
    "no num_shards": (_edit_manifest(lambda m: m.pop("num_shards")), MANIFEST, "num_shards"),
    "part byte flipped": (_flip_byte(_first_part), PART, "SHA-256 differs"),
    "truncated part": (lambda s: _first_part(s).write_bytes(_first_part(s).read_bytes()[:200]),
                       PART, "bytes, its manifest records"),
    "missing part": (lambda s: _first_part(s).unlink(), PART, "part file is missing"),
    "interrupted save": (lambda s: (s / "manifest.json").unlink(), MANIFEST, "incomplete snapshot"),
    "file outside": (_edit_manifest(lambda m: m["tables"][0]["parts"][0].update(file="../x.part")),
                     MANIFEST, "part file name"),
    "part count": (_edit_manifest(lambda m: m["tables"][0]["parts"].pop()), MANIFEST,
                   "one part per shard"),
    "unknown optimizer": (_edit_manifest(lambda m: m["tables"][0]["config"].update(optimizer="adam")),
                          MANIFEST, "bad table config.*optimizer"),
    "no dim": (_edit_manifest(lambda m: m["tables"][0]["config"].pop("dim")), MANIFEST,
               "bad table config"),
    "dim differs": (_edit_manifest(lambda m: m["tables"][0]["config"].update(dim=DIM + 1)),
                    MANIFEST, "layout entry"),
    "repeated table": (_edit_manifest(lambda m: m["tables"].append(m["tables"][0])), MANIFEST,
                       "repeat"),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_load_rejects_corrupt_snapshot_naming_the_file(tmp_path, corruption):
    kb = make_bank(num_shards=2)
    kb.lookup("emb", np.arange(1, 20), insert_missing=True)
    kb.apply_gradients("emb", [1, 2], np.ones((2, DIM)))
    kb.save(tmp_path / "snap")
    edit, named, match = CORRUPTIONS[corruption]
    edit(tmp_path / "snap")
    for num_shards in (None, 3):  # each shard its own part, and every part streamed
        with pytest.raises(CorruptFileError, match=match) as caught:
            KnowledgeBank.load(tmp_path / "snap", num_shards=num_shards)
        assert caught.value.path.endswith(named)
        assert isinstance(caught.value, ValueError)


def test_load_rejects_pending_gradients_of_keys_without_a_row(tmp_path):
    kb = make_bank(num_shards=2)
    kb.lookup("emb", np.arange(1, 20), insert_missing=True)
    kb.apply_gradients("emb", np.arange(1, 20), np.ones((19, DIM)))
    kb.save(tmp_path / "snap")
    _edit_part_column("pending_keys", lambda keys: keys.__setitem__(0, 10**9))(tmp_path / "snap")
    with pytest.raises(ValueError, match="pending gradients of keys that have no row"):
        KnowledgeBank.load(tmp_path / "snap")


def test_save_and_load_through_an_fsspec_url_and_into_other_shard_counts(bank_contents,
                                                                        assert_same_contents):
    kb = make_bank(num_shards=2, optimizer="adagrad", max_pending=100)
    kb.create_feature_table("nbrs", {"ids": ("int64", 2), "w": ("float32", 2)})
    keys = np.arange(1, 5000)
    kb.apply_gradients("emb", keys, np.ones((len(keys), DIM)))
    kb.lookup("emb", keys[::2])
    kb.apply_gradients("emb", keys[:100], np.full((100, DIM), 2.0))
    kb.update("nbrs", keys[:10], {"ids": np.ones((10, 2), int), "w": np.ones((10, 2))}, version=4)
    url = f"memory://carlskit-test-{uuid.uuid4().hex}/snap"
    kb.save(url)
    expected = bank_contents(kb)
    for num_shards in (1, 2, 5):
        restored = KnowledgeBank.load(url, num_shards=num_shards)
        assert_same_contents(expected, bank_contents(restored))
        np.testing.assert_array_equal(restored.lookup("emb", keys)[0], kb.lookup("emb", keys)[0])
    kb.save(url)  # over the earlier snapshot: its parts are replaced, nothing else is left
    names = [p.rsplit("/", 1)[-1] for p in fsspec.filesystem("memory").ls(url[len("memory://"):],
                                                                          detail=False)]
    assert "manifest.json" in names and len(names) == 1 + 2 * 2  # 2 tables x 2 shards


def test_rerouting_reads_parts_in_bounded_chunks(tmp_path, monkeypatch, bank_contents,
                                                 assert_same_contents):
    import carlskit.bank._snapshot as snapshot

    monkeypatch.setattr(snapshot, "REROUTE_CHUNK_ROWS", 7)
    monkeypatch.setattr("carlskit.bank._tables.REROUTE_CHUNK_ROWS", 7)
    kb = make_bank(num_shards=3, max_pending=100)
    kb.apply_gradients("emb", np.arange(1, 300), np.ones((299, DIM)))
    kb.save(tmp_path / "snap")
    restored = KnowledgeBank.load(tmp_path / "snap", num_shards=2)
    assert_same_contents(bank_contents(kb), bank_contents(restored))


def test_load_missing_snapshot_and_bad_shard_count(tmp_path):
    with pytest.raises(FileNotFoundError, match="no KnowledgeBank snapshot"):
        KnowledgeBank.load(tmp_path / "nowhere")
    make_bank().save(tmp_path / "snap")
    with pytest.raises(ValueError, match="num_shards"):
        KnowledgeBank.load(tmp_path / "snap", num_shards=0)


def test_save_load_keeps_counters_of_an_empty_table_on_several_shards(tmp_path):
    kb = make_bank(num_shards=3)
    kb.lookup("emb", [1, 2])  # absent: counts shard calls, inserts nothing
    kb.save(tmp_path / "snap")
    restored = KnowledgeBank.load(tmp_path / "snap")
    assert restored.stats()["tables"]["emb"]["rows"] == 0
    assert (restored.stats()["tables"]["emb"]["lookup_shard_calls"]
            == kb.stats()["tables"]["emb"]["lookup_shard_calls"] > 0)


def test_snapshot_manifest_is_strict_json_with_an_infinite_ttl(tmp_path):
    kb = make_bank(pending_ttl_seconds=float("inf"))
    kb.apply_gradients("emb", [1], np.ones((1, DIM)))
    kb.save(tmp_path / "snap")
    json.loads((tmp_path / "snap" / "manifest.json").read_text(),
               parse_constant=lambda name: pytest.fail(f"non-standard JSON constant {name}"))
    loads_checked_json((tmp_path / "snap" / "manifest.json").read_bytes())  # checksummed
    restored = KnowledgeBank.load(tmp_path / "snap")
    assert restored.tables["emb"]["pending_ttl_seconds"] == float("inf")
    assert restored.stats()["tables"]["emb"]["pending_gradients"] == 1


def test_editing_the_tables_property_changes_nothing():
    kb = make_bank(num_shards=2)
    kb.create_feature_table("nbrs", {"ids": ("int64", 2)})
    kb.update("nbrs", [1], {"ids": [[5, 6]]})
    kb.tables["nbrs"]["schema"]["ids"][1] = 3
    kb.tables["emb"]["dim"] = 1
    assert kb.tables["nbrs"]["schema"]["ids"] == ["int64", 2]
    np.testing.assert_array_equal(kb.lookup("nbrs", [1])[0]["ids"], [[5, 6]])
