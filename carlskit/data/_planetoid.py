"""The original Planetoid files (Yang, Cohen & Salakhutdinov 2016) and their conversion to ``.npz``.

Every graph library downloads the same eight files per data set from the Planetoid repository
(github kimiyoung/planetoid, ``data/``)::

    ind.NAME.x      scipy CSR [n_train, D]   features of the labelled training nodes
    ind.NAME.y      ndarray   [n_train, C]   their one-hot labels
    ind.NAME.allx   scipy CSR [n_all, D]     features of every non-test node (training ones first)
    ind.NAME.ally   ndarray   [n_all, C]     their one-hot labels (all-zero: no label)
    ind.NAME.tx     scipy CSR [n_test, D]    features of the test nodes, in test.index order
    ind.NAME.ty     ndarray   [n_test, C]    their one-hot labels
    ind.NAME.graph  defaultdict(list)        node id -> neighbour ids (directed lists, duplicates)
    ind.NAME.test.index  text, one id a line the graph ids of the tx/ty rows

They are Python 2 pickles. A pickle can run any code while it loads, and these come from the
internet, so :class:`_PlanetoidUnpickler` admits only the handful of globals they use (numpy's
array reconstruction, ``numpy.dtype``, scipy's ``csr_matrix``, ``collections.defaultdict``,
``list``) and refuses everything else with :class:`UnsafePickleError`. A CSR matrix is never built
by scipy: its pickled state is captured in a plain record and densified here, so no scipy code runs.

The conversion is the one GCN (Kipf & Welling 2017, ``gcn/utils.py: load_data``) made standard:
node ids are ``allx`` rows then the test range; the test rows are put at their ``test.index`` ids;
the test range's ids that are missing from ``test.index`` (Citeseer's isolated nodes) get zero
features and no label (-1); ``train_idx`` = the first ``len(y)`` nodes, ``val_idx`` = the next 500,
``test_idx`` = the sorted ``test.index``; edges are the graph's undirected pairs, each once with
i < j, self-loops dropped, sorted.
"""

from __future__ import annotations

import collections
import os
import pickle
from pathlib import Path

import numpy as np

from carlskit._errors import CorruptFileError

#: The eight files of one Planetoid data set, in the order they are fetched.
PLANETOID_SUFFIXES = ("x", "y", "tx", "ty", "allx", "ally", "graph", "test.index")
#: Validation nodes follow the training nodes (Kipf & Welling's split, used by GCN, GAT, GAM).
NUM_VALIDATION = 500


class UnsafePickleError(ValueError):
    """A pickle asked for a global outside the few that Planetoid files use; nothing was run."""

    def __init__(self, path: str | os.PathLike, name: str) -> None:
        self.path, self.name = os.fspath(path), name
        super().__init__(f"{self.path}: refusing to load {name!r} from this pickle: Planetoid files may only "
                         f"hold numpy arrays, scipy CSR matrices and a defaultdict of lists")

    def __reduce__(self):
        return (type(self), (self.path, self.name))


class _CSRRecord:
    """The pickled state of a ``scipy.sparse.csr_matrix`` (``data``, ``indices``, ``indptr``,
    ``_shape``), captured without importing or running scipy."""

    def dense(self, path: str | os.PathLike) -> np.ndarray:
        state = self.__dict__
        try:
            rows, columns = (int(n) for n in state.get("_shape", state.get("shape")))
            data, indices, indptr = (np.asarray(state[k]) for k in ("data", "indices", "indptr"))
        except (KeyError, TypeError, ValueError) as error:
            raise CorruptFileError(path, f"not a CSR matrix's state: {error}") from None
        if indptr.shape != (rows + 1,) or indices.shape != data.shape or int(indptr[-1]) != len(data) \
                or (len(indices) and (indices.min() < 0 or indices.max() >= columns)):
            raise CorruptFileError(path, f"inconsistent CSR matrix of shape {(rows, columns)}")
        dense = np.zeros((rows, columns), dtype=np.float32)
        row_of = np.repeat(np.arange(rows), np.diff(indptr))
        np.add.at(dense, (row_of, indices), data.astype(np.float32))  # CSR sums duplicate entries
        return dense


# numpy's array-reconstruction function, wherever this numpy keeps it (numpy.core in 1.x, numpy._core in 2.x).
_RECONSTRUCT = np.array(0).__reduce__()[0]
_ADMITTED = {
    ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("scipy.sparse.csr", "csr_matrix"): _CSRRecord,
    ("scipy.sparse._csr", "csr_matrix"): _CSRRecord,
    ("collections", "defaultdict"): collections.defaultdict,
    ("__builtin__", "list"): list,
    ("builtins", "list"): list,
}


class _PlanetoidUnpickler(pickle.Unpickler):
    def __init__(self, file, path: str | os.PathLike) -> None:
        super().__init__(file, encoding="latin1")  # Python 2 str payloads are raw array bytes
        self._path = path

    def find_class(self, module: str, name: str):
        try:
            return _ADMITTED[(module, name)]
        except KeyError:
            raise UnsafePickleError(self._path, f"{module}.{name}") from None


def load_planetoid_pickle(path: str | os.PathLike):
    """Unpickle one Planetoid file admitting only the classes listed in :data:`_ADMITTED`.

    Returns an ndarray, a dense float32 array (for a CSR matrix) or a ``defaultdict``. Raises
    :class:`UnsafePickleError` for any other global and :class:`CorruptFileError` for a damaged file.
    """
    with open(path, "rb") as handle:
        try:
            value = _PlanetoidUnpickler(handle, path).load()
        except UnsafePickleError:
            raise
        except Exception as error:  # a truncated or garbled pickle raises any of many types
            raise CorruptFileError(path, f"unreadable pickle: {type(error).__name__}: {error}") from None
    if isinstance(value, _CSRRecord):
        return value.dense(path)
    return value


def raw_file(directory: str | os.PathLike, name: str, suffix: str) -> Path:
    return Path(directory) / f"ind.{name}.{suffix}"


def read_planetoid_raw(directory: str | os.PathLike, name: str) -> dict[str, np.ndarray]:
    """The arrays of :func:`carlskit.data.load_planetoid`'s format from the eight original files
    ``ind.NAME.*`` in ``directory`` (see the module docstring for the conversion)."""
    missing = [str(raw_file(directory, name, s)) for s in PLANETOID_SUFFIXES
               if not raw_file(directory, name, s).is_file()]
    if missing:
        raise FileNotFoundError(f"Planetoid files missing: {', '.join(missing)}")
    parts = {}
    for suffix in ("x", "y", "tx", "ty", "allx", "ally", "graph"):
        path = raw_file(directory, name, suffix)
        value = load_planetoid_pickle(path)
        expected = dict if suffix == "graph" else np.ndarray
        if not isinstance(value, expected) or (expected is np.ndarray and value.ndim != 2):
            raise CorruptFileError(path, f"expected a {'dict' if expected is dict else 'matrix'}, "
                                         f"got {type(value).__name__}")
        parts[suffix] = value
    index_path = raw_file(directory, name, "test.index")
    try:
        test_index = np.array([int(line) for line in index_path.read_text().split()], dtype=np.int64)
    except ValueError as error:
        raise CorruptFileError(index_path, f"not one integer a line: {error}") from None
    x, y, tx, ty, allx, ally, graph = (parts[k] for k in ("x", "y", "tx", "ty", "allx", "ally", "graph"))
    if len(tx) != len(test_index) or len(ty) != len(test_index) or len(x) != len(y) or len(allx) != len(ally):
        raise CorruptFileError(index_path, f"row counts disagree: x {len(x)}, y {len(y)}, allx {len(allx)}, "
                                           f"ally {len(ally)}, tx {len(tx)}, ty {len(ty)}, "
                                           f"test.index {len(test_index)}")
    test_sorted = np.sort(test_index)
    first, last = int(test_sorted[0]), int(test_sorted[-1])
    if first != len(allx):
        raise CorruptFileError(index_path, f"the test range starts at {first}, expected {len(allx)} (after allx)")
    # The whole test range, including ids absent from test.index (Citeseer's isolated nodes: zero rows).
    span = last - first + 1
    test_features = np.zeros((span, tx.shape[1]), dtype=np.float32)
    test_labels = np.zeros((span, ty.shape[1]), dtype=ty.dtype)
    test_features[test_index - first] = tx
    test_labels[test_index - first] = ty
    features = np.concatenate([allx.astype(np.float32), test_features])
    onehot = np.concatenate([ally, test_labels])
    labels = np.where(onehot.any(axis=1), onehot.argmax(axis=1), -1).astype(np.int64)
    num_nodes = len(features)
    pairs = [(int(i), int(j)) for i, neighbours in graph.items() for j in neighbours]
    edges = np.array(pairs, dtype=np.int64).reshape(-1, 2)
    if edges.size and (edges.min() < 0 or edges.max() >= num_nodes):
        raise CorruptFileError(raw_file(directory, name, "graph"), f"node ids outside [0, {num_nodes})")
    edges = np.sort(edges, axis=1)
    edges = np.unique(edges[edges[:, 0] != edges[:, 1]], axis=0)  # unique rows come back lexsorted
    num_train = len(y)
    return {
        "features": features,
        "labels": labels,
        "edges": edges,
        "train_idx": np.arange(num_train, dtype=np.int64),
        "val_idx": np.arange(num_train, min(num_train + NUM_VALIDATION, len(allx)), dtype=np.int64),
        "test_idx": test_sorted,
    }
