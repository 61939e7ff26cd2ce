"""Key admission (min_count) and eviction (idle time, capacity) of embedding tables, counted in stats()."""

import numpy as np
import pytest

from carlskit import KnowledgeBank
from carlskit.bank._hashing import initial_values


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_key_gets_a_row_only_after_min_count_lookups():
    bank = KnowledgeBank()
    bank.create_table("t", 4, min_count=3)
    keys = np.array([7, 8])
    config = bank.tables["t"]
    initial = initial_values(keys, 4, config["initializer"], config["seed"], config["init_scale"])
    for call in range(2):
        values, found = bank.lookup("t", keys, insert_missing=True)
        np.testing.assert_array_equal(values, initial)  # the initializer's value, without a row
        assert not found.any()
        bank.apply_gradients("t", keys, np.ones((2, 4), np.float32))  # dropped: no row to train
    stats = bank.stats()["tables"]["t"]
    assert (stats["rows"], stats["keys_not_admitted"], stats["gradients_not_admitted"]) == (0, 4, 4)
    bank.lookup("t", keys[:1], insert_missing=True)  # the third sighting of key 7 admits it
    values, found = bank.lookup("t", keys, insert_missing=False)
    np.testing.assert_array_equal(found, [True, False])
    np.testing.assert_array_equal(values[0], initial[0])  # a fresh row: no gradient reached it before
    assert bank.stats()["tables"]["t"]["rows"] == 1
    bank.update("t", keys[1:], np.zeros((1, 4)))  # an explicit write is not subject to admission
    assert bank.stats()["tables"]["t"]["rows"] == 2


def test_rows_idle_longer_than_max_idle_seconds_are_evicted():
    clock = Clock()
    bank = KnowledgeBank(clock=clock)
    bank.create_table("t", 2, initializer="zeros", max_idle_seconds=10.0, learning_rate=1.0, max_pending=4)
    bank.lookup("t", np.arange(6), insert_missing=True)  # t = 0
    clock.now = 8.0
    bank.lookup("t", np.array([1, 2]))  # accessed at t = 8
    bank.apply_gradients("t", np.array([3]), np.ones((1, 2), np.float32))  # accessed at t = 8, cached
    clock.now = 12.0
    stats = bank.stats()["tables"]["t"]  # the call that reaches the shard evicts first
    assert stats["rows"] == 3 and stats["rows_evicted_idle"] == 3
    values, found = bank.lookup("t", np.array([0, 1, 3]))
    np.testing.assert_array_equal(found, [False, True, True])
    np.testing.assert_array_equal(values[2], [-1.0, -1.0])  # the cached gradient survived the compaction
    clock.now = 30.0
    assert bank.stats()["tables"]["t"]["rows"] == 0


def test_rows_beyond_max_rows_per_shard_evict_the_least_recently_accessed():
    clock = Clock()
    bank = KnowledgeBank(clock=clock)
    bank.create_table("t", 2, max_rows_per_shard=10)
    for key in range(12):  # key k accessed at t = k
        clock.now = float(key)
        bank.lookup("t", np.array([key]), insert_missing=True)
    # t = 10 made 11 rows; the call at t = 11 evicted down to 90% of 10 (keys 0 and 1), then inserted key 11
    stats = bank.stats()["tables"]["t"]
    assert stats["rows"] == 10 and stats["rows_evicted_capacity"] == 2
    _, found = bank.lookup("t", np.arange(12))
    np.testing.assert_array_equal(found, [False] * 2 + [True] * 10)


@pytest.mark.parametrize("options, error, name", [
    ({"min_count": 0}, ValueError, "min_count"),
    ({"max_idle_seconds": 0.0}, ValueError, "max_idle_seconds"),
    ({"max_rows_per_shard": 0}, ValueError, "max_rows_per_shard"),
    ({"max_rows_per_shard": 5, "index": "hnsw"}, ValueError, "index='flat'"),
])
def test_bad_admission_or_eviction_options_are_named(options, error, name):
    bank = KnowledgeBank()
    with pytest.raises(error, match=name):
        bank.create_table("t", 2, **options)
    assert bank.tables == {}
