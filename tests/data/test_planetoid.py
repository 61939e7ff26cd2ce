"""The original Planetoid files: restricted unpickling, conversion, the shipped data/ and the data folders."""

from __future__ import annotations

import hashlib
import io
import os
import pickle
from pathlib import Path

import numpy as np
import pytest

from carlskit._errors import CorruptFileError
from carlskit.data import (
    PLANETOID_SHA256,
    DatasetNotFoundError,
    UnsafePickleError,
    data_dirs,
    load_planetoid,
    load_planetoid_pickle,
    planetoid_path,
    read_planetoid_raw,
)

ROOT = Path(__file__).resolve().parents[2]
RAW = ROOT / "data" / "planetoid" / "raw"
SHARED = ROOT.parent / "shared" / "data" / "planetoid"

# sha256 (first 32 hex digits) of each array's bytes in the reference archives that the project's
# data README describes (shared/data/planetoid/{cora,citeseer}.npz), recorded so that the comparison
# runs on a fresh clone without them; where they are present the arrays are also compared directly.
REFERENCE = {
    "cora": {
        "features": ("float32", (2708, 1433), "f0faab5177bcc12f5688f042c8e0ed24"),
        "labels": ("int64", (2708,), "d0018d7ffd314eb25a4904973f2c7eb1"),
        "edges": ("int64", (5278, 2), "77b2d0ad6bdc31beefce3956fca3e6c6"),
        "train_idx": ("int64", (140,), "a103a53f219cde44e3628ccf636c012f"),
        "val_idx": ("int64", (500,), "ade6bc10376e996ed21ae31286a4d8df"),
        "test_idx": ("int64", (1000,), "16680ae981534bf8b04697b2c29ae6aa"),
    },
    "citeseer": {
        "features": ("float32", (3327, 3703), "cb9a425333dd8d1ae650e0eb4f3d65b1"),
        "labels": ("int64", (3327,), "a33560b649dadb27528b35f6bf2a3976"),
        "edges": ("int64", (4552, 2), "a175d643c1915f9e7325ed345ff16c86"),
        "train_idx": ("int64", (120,), "fc256ff91ecfd419717ef3077f33d0d6"),
        "val_idx": ("int64", (500,), "e874e9d9d0c284581fd1c22fc992da67"),
        "test_idx": ("int64", (1000,), "e85e8126e95f8d182d9e4a776c58434e"),
    },
}


def _digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()[:32]


@pytest.mark.parametrize("name", ["cora", "citeseer"])
def test_shipped_raw_files_are_the_published_ones(name):
    for suffix, expected in PLANETOID_SHA256[name].items():
        assert hashlib.sha256((RAW / f"ind.{name}.{suffix}").read_bytes()).hexdigest() == expected, suffix
    assert (ROOT / "data" / "planetoid" / "LICENSE").read_text().startswith("The MIT License")


@pytest.mark.parametrize("name", ["cora", "citeseer"])
def test_conversion_equals_the_reference_arrays_exactly(name):
    arrays = read_planetoid_raw(RAW, name)
    assert {k: (str(v.dtype), v.shape, _digest(v)) for k, v in arrays.items()} == REFERENCE[name]
    if (SHARED / f"{name}.npz").is_file():
        with np.load(SHARED / f"{name}.npz", allow_pickle=False) as reference:
            for key in reference.files:
                np.testing.assert_array_equal(arrays[key], reference[key], err_msg=key)


@pytest.mark.parametrize("name", ["cora", "citeseer"])
def test_shipped_npz_is_the_projects_own_conversion(name):
    converted = read_planetoid_raw(RAW, name)
    with np.load(ROOT / "data" / "planetoid" / f"{name}.npz", allow_pickle=False) as shipped:
        assert sorted(shipped.files) == sorted(converted)
        for key in shipped.files:
            assert shipped[key].dtype == converted[key].dtype, key
            np.testing.assert_array_equal(shipped[key], converted[key], err_msg=key)


def test_citeseer_isolated_test_nodes_have_no_label_and_no_split():
    data = load_planetoid("citeseer")
    unlabelled = np.flatnonzero(data.labels < 0)
    assert len(unlabelled) == 15
    assert not np.isin(unlabelled, np.concatenate([data.train_idx, data.val_idx, data.test_idx])).any()
    assert (data.features[unlabelled] == 0).all()


def test_cora_is_found_with_no_setup_in_the_checkouts_data_folder(monkeypatch):
    monkeypatch.delenv("CARLSKIT_DATA", raising=False)
    monkeypatch.delenv("CARLSKIT_PLANETOID_DIR", raising=False)
    assert planetoid_path("cora") == ROOT / "data" / "planetoid" / "cora.npz"
    data = load_planetoid("cora")
    assert data.name == "cora" and (data.num_items, data.num_features, data.num_classes) == (2708, 1433, 7)


def _tiny_graph(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, features=np.eye(3, dtype=np.float32), labels=np.array([0, 1, -1]), edges=np.array([[0, 1]]),
             train_idx=np.array([0]), val_idx=np.array([1]), test_idx=np.array([2]))


def test_carlskit_data_is_searched_first_and_the_old_variable_still_works(tmp_path, monkeypatch):
    monkeypatch.delenv("CARLSKIT_PLANETOID_DIR", raising=False)
    _tiny_graph(tmp_path / "mine" / "planetoid" / "cora.npz")
    monkeypatch.setenv("CARLSKIT_DATA", str(tmp_path / "mine"))
    assert data_dirs()[0] == tmp_path / "mine"
    assert load_planetoid("cora").num_items == 3
    assert load_planetoid("citeseer").num_items == 3327, "the checkout's data/ is still searched after it"
    _tiny_graph(tmp_path / "old" / "citeseer.npz")
    monkeypatch.setenv("CARLSKIT_PLANETOID_DIR", str(tmp_path / "old"))
    assert load_planetoid("citeseer").num_items == 3


def test_a_missing_data_set_names_the_paths_tried_and_the_fetch_command(tmp_path, monkeypatch):
    monkeypatch.setenv("CARLSKIT_DATA", str(tmp_path))
    monkeypatch.setitem(PLANETOID_SHA256, "cora", None)  # pretend cora were unpinned: the hint says --unpinned
    with pytest.raises(DatasetNotFoundError) as error:
        load_planetoid("nosuchgraph")
    message = str(error.value)
    assert "\n" not in message and str(tmp_path / "planetoid" / "nosuchgraph.npz") in message
    assert "python -m carlskit.data convert planetoid nosuchgraph" in message
    with pytest.raises(DatasetNotFoundError, match="no graph file 'elsewhere/cora.npz'.*pass the name 'cora'"):
        load_planetoid("elsewhere/cora.npz")
    assert isinstance(error.value, FileNotFoundError)


def test_a_damaged_npz_is_reported_as_corrupt_naming_the_file(tmp_path):
    path = tmp_path / "broken.npz"
    path.write_bytes((ROOT / "data" / "planetoid" / "cora.npz").read_bytes()[:5000])
    with pytest.raises(CorruptFileError, match="broken.npz"):
        load_planetoid(path)


class _RunsCode:
    def __reduce__(self):
        return (os.mkdir, ("should-never-exist",))


def test_the_unpickler_refuses_any_other_global_and_runs_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "ind.evil.x"
    path.write_bytes(pickle.dumps(_RunsCode(), protocol=2))
    with pytest.raises(UnsafePickleError, match=r"ind\.evil\.x: refusing to load 'posix\.mkdir'"):
        load_planetoid_pickle(path)
    assert not (tmp_path / "should-never-exist").exists()
    buffer = io.BytesIO()
    pickle.dump({"a": np.float64(1.0)}, buffer, protocol=2)  # numpy scalars are not in the files: refused too
    path.write_bytes(buffer.getvalue())
    with pytest.raises(UnsafePickleError):
        load_planetoid_pickle(path)


def test_the_unpickler_reads_the_sparse_matrices_without_scipy_and_a_cut_file_is_corrupt(tmp_path):
    x = load_planetoid_pickle(RAW / "ind.cora.x")
    assert x.shape == (140, 1433) and x.dtype == np.float32 and set(np.unique(x)) == {0.0, 1.0}
    cut = tmp_path / "ind.cora.x"
    cut.write_bytes((RAW / "ind.cora.x").read_bytes()[:1000])
    with pytest.raises(CorruptFileError, match="ind.cora.x"):
        load_planetoid_pickle(cut)
