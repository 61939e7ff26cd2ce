"""The bank's key -> row map against a Python dict: random keys, keys crowded into a few home
buckets (long overflow chains, wrapping past the last bucket), absent keys, growth."""

import numpy as np
import pytest

from carlskit.bank._hashmap import BUCKET, Int64RowMap


def check_against_dict(row_map: Int64RowMap, model: dict[int, int], probes: np.ndarray) -> None:
    got = row_map.get(probes)
    assert got.dtype == np.int64 and got.shape == probes.shape
    expected = np.array([model.get(int(key), -1) for key in probes], dtype=np.int64)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_keys_in_batches_with_growth_match_a_dict(seed):
    rng = np.random.default_rng(seed)
    row_map, model = Int64RowMap(capacity=4), {}
    for _ in range(12):
        batch = np.unique(rng.integers(0, 1 << 40, size=int(rng.integers(1, 3000))))
        batch = batch[[int(key) not in model for key in batch]]
        rows = row_map.insert_new(batch)
        model.update(zip(batch.tolist(), rows.tolist()))
        absent = rng.integers(1 << 41, 1 << 42, size=500)
        present = np.fromiter(model, dtype=np.int64)[rng.integers(0, len(model), size=2000)]
        check_against_dict(row_map, model, rng.permutation(np.concatenate([present, absent])))


def crowded_keys(row_map: Int64RowMap, home: int, count: int, seed: int) -> np.ndarray:
    """``count`` distinct keys whose home bucket is ``home`` (found by drawing)."""
    rng, found = np.random.default_rng(seed), []
    while sum(map(len, found)) < count:
        draw = rng.integers(0, 1 << 50, size=1 << 16)
        found.append(draw[row_map._home(draw) == home])
    return np.unique(np.concatenate(found))[:count]


@pytest.mark.parametrize("home_of", ["first", "last"])
def test_keys_overflowing_many_buckets_are_found_and_absent_ones_are_not(home_of):
    # 64 buckets of 8; 60 keys with the same home fill 7.5 buckets after it (wrapping from the last)
    row_map = Int64RowMap(capacity=256)
    num_buckets = len(row_map.bucket_fill)
    home = 0 if home_of == "first" else num_buckets - 1
    keys = crowded_keys(row_map, home, 60, seed=3)
    spread = np.random.default_rng(4).integers(0, 1 << 50, size=40)
    spread = spread[~np.isin(spread, keys)]
    model = {}
    for batch in (keys[:30], spread, keys[30:]):
        model.update(zip(batch.tolist(), row_map.insert_new(batch).tolist()))
    assert (row_map.bucket_fill == BUCKET).sum() >= 7, "the crowded keys really overflow"
    absent_same_home = crowded_keys(row_map, home, 90, seed=5)
    absent_same_home = absent_same_home[~np.isin(absent_same_home, keys)]
    probes = np.concatenate([keys, spread, absent_same_home, keys[::-1]])
    check_against_dict(row_map, model, probes)
    for size in (1, 7, 63):  # small batches take the same paths
        check_against_dict(row_map, model, probes[:size])


def test_an_empty_map_and_an_empty_batch():
    row_map = Int64RowMap()
    np.testing.assert_array_equal(row_map.get(np.array([5, 6], dtype=np.int64)), [-1, -1])
    assert row_map.get(np.array([], dtype=np.int64)).shape == (0,)
