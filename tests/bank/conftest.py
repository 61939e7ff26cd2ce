import json
import pathlib

import numpy as np
import pytest
from process_helpers import checkout_cluster


@pytest.fixture(scope="module")
def client():
    """A 2-worker LocalCluster per test module (worker processes import this checkout)."""
    with checkout_cluster(2) as dask_client:
        yield dask_client


class FakeClock:
    """A settable clock so ttl flushes and write times are exact."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return FakeClock()


def read_snapshot_columns(directory: pathlib.Path) -> tuple[dict, dict]:
    """(manifest content, {table: {column: array over all parts}}) of a snapshot directory, read
    from its documented layout (raw columns at the offsets the manifest lists), not through the
    bank. The shards' hash maps (row_map_*) are left out: they depend on the sharding."""
    manifest = json.loads((directory / "manifest.json").read_text())["content"]
    tables = {}
    for entry in manifest["tables"]:
        columns: dict = {}
        for part in entry["parts"]:
            data = (directory / part["file"]).read_bytes()
            for name, dtype, shape, offset in part["layout"]:
                if name.startswith("row_map_"):
                    continue
                size = np.dtype(dtype).itemsize * int(np.prod(shape))
                array = np.frombuffer(data[offset:offset + size], dtype=dtype).reshape(shape)
                columns.setdefault(name, []).append(array)
        tables[entry["name"]] = {name: np.concatenate(arrays) for name, arrays in columns.items()}
    return manifest, tables


def _bank_contents(kb, directory: pathlib.Path) -> dict:
    """Every array and counter of the bank, read back through a snapshot (public API only)."""
    kb.save(directory)
    manifest, tables = read_snapshot_columns(directory)
    out = {"tables": {t["name"]: (t["config"], t["counters"]) for t in manifest["tables"]}}
    for name, data in tables.items():
        order = np.argsort(data["keys"])  # rows: by key; pending: by time, then key (stable)
        pending_order = (np.lexsort((data["pending_keys"], data["pending_times"]))
                         if "pending_keys" in data else None)
        for column, array in data.items():
            out[name, column] = array[pending_order if column.startswith("pending") else order]
    return out


def _assert_same_contents(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], np.ndarray):
            np.testing.assert_array_equal(a[key], b[key], err_msg=str(key))
        else:
            assert a[key] == b[key], key


@pytest.fixture
def bank_contents(tmp_path):
    """bank_contents(kb) -> every array and counter of kb, via a fresh snapshot directory."""
    counter = iter(range(10**6))
    return lambda kb: _bank_contents(kb, tmp_path / f"contents-{next(counter)}")


@pytest.fixture
def assert_same_contents():
    return _assert_same_contents
