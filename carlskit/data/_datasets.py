"""Data sets for the CARLS paradigms.

Both loaders return a :class:`Dataset`: node (item) features, labels, the labelled / validation /
test index splits and, for graphs, the undirected edge list. Items are identified by their row index,
which is also their key in the knowledge bank.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_PLANETOID_ARRAYS = {
    "features": (np.floating, 2),
    "labels": (np.integer, 1),
    "edges": (np.integer, 2),
    "train_idx": (np.integer, 1),
    "val_idx": (np.integer, 1),
    "test_idx": (np.integer, 1),
}


@dataclass(frozen=True)
class Dataset:
    """Items with features and labels, split into labelled (train), validation and test indices.

    ``labels`` is -1 where an item has no label at all; items outside ``train_idx`` are treated as
    unlabelled during training whatever their label. ``edges`` is [M, 2] int64 (undirected, each
    pair once) or ``None`` when the data set has no given graph.
    """

    name: str
    features: np.ndarray
    labels: np.ndarray
    train_idx: np.ndarray
    val_idx: np.ndarray
    test_idx: np.ndarray
    num_classes: int
    edges: np.ndarray | None = None

    @property
    def num_items(self) -> int:
        return int(self.features.shape[0])

    @property
    def num_features(self) -> int:
        return int(self.features.shape[1])

    def __repr__(self) -> str:
        edges = "no graph" if self.edges is None else f"{len(self.edges)} edges"
        return (
            f"Dataset({self.name!r}: {self.num_items} items x {self.num_features} features, "
            f"{self.num_classes} classes, {len(self.train_idx)} labelled / {len(self.val_idx)} val / "
            f"{len(self.test_idx)} test, {edges})"
        )


def load_digits(label_fraction: float = 0.05, *, seed: int = 0, test_fraction: float = 0.3,
                val_fraction: float = 0.1) -> Dataset:
    """scikit-learn's 8x8 digits (1797 images, shipped with the package) as a semi-supervised set.

    The images are shuffled with ``seed`` and split into test, validation and training parts; of the
    training part, ``label_fraction`` keeps its labels (at least one per class), the rest is unlabelled.
    Features are pixel intensities scaled to [0, 1].
    """
    from sklearn.datasets import load_digits as sklearn_digits

    if not 0.0 < label_fraction <= 1.0:
        raise ValueError(f"label_fraction must be in (0, 1], got {label_fraction!r}")
    if not 0.0 < test_fraction < 1.0 or not 0.0 <= val_fraction < 1.0 or test_fraction + val_fraction >= 1:
        raise ValueError(
            f"test_fraction and val_fraction must be in [0, 1) and sum below 1, "
            f"got {test_fraction!r} and {val_fraction!r}"
        )
    digits = sklearn_digits()
    features = (digits.data / 16.0).astype(np.float32)
    labels = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(labels))
    num_test = int(round(test_fraction * len(labels)))
    num_val = int(round(val_fraction * len(labels)))
    test_idx, val_idx, pool = order[:num_test], order[num_test:num_test + num_val], order[num_test + num_val:]
    num_labelled = max(int(round(label_fraction * len(pool))), 10)
    # One item of every class first, so no class is entirely unlabelled, then the rest in order.
    first_of_class = np.array([pool[labels[pool] == c][0] for c in range(10)])
    rest = pool[~np.isin(pool, first_of_class)]
    train_idx = np.concatenate([first_of_class, rest[: num_labelled - 10]])
    return Dataset(
        name=f"digits-{label_fraction:g}",
        features=features,
        labels=labels,
        train_idx=np.sort(train_idx).astype(np.int64),
        val_idx=np.sort(val_idx).astype(np.int64),
        test_idx=np.sort(test_idx).astype(np.int64),
        num_classes=10,
    )


class DatasetNotFoundError(FileNotFoundError):
    """A data set asked for by name or path is not on this machine; the message is one line that
    names what was tried and the command that fetches it."""


def _repository_data() -> Path | None:
    """The ``data/`` folder of the source checkout this package runs from (a clone, an editable
    install or ``PYTHONPATH``), or ``None`` for an installed wheel."""
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file() and (root / "data" / "planetoid").is_dir():
        return root / "data"
    return None


def _package_data() -> Path | None:
    """The data sets shipped inside an installed wheel (``carlskit._shipped_data``: the checkout's
    ``data/``, converted files only), or ``None`` when this install has none."""
    try:
        spec = importlib.util.find_spec("carlskit._shipped_data")
    except ModuleNotFoundError:
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations)))
    return folder if (folder / "planetoid").is_dir() else None


def _user_data() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "carlskit" / "data"


def data_dirs() -> list[Path]:
    """The folders searched for data sets, first match wins: ``$CARLSKIT_DATA``, the checkout's
    ``data/`` (Cora and Citeseer ship there), the per-user ``~/.cache/carlskit/data``
    (``$XDG_CACHE_HOME``), where a wheel install fetches to, and last the data shipped inside an
    installed wheel (read-only: nothing is ever written there)."""
    folders = [Path(os.environ["CARLSKIT_DATA"])] if os.environ.get("CARLSKIT_DATA") else []
    repository = _repository_data()
    if repository is not None:
        folders.append(repository)
    folders.append(_user_data())
    shipped = _package_data()
    if shipped is not None and shipped not in folders:
        folders.append(shipped)
    return folders


def data_dir() -> Path:
    """Where ``python -m carlskit.data fetch`` writes: the first of :func:`data_dirs`."""
    return data_dirs()[0]


def _planetoid_dirs() -> list[Path]:
    legacy = [Path(os.environ["CARLSKIT_PLANETOID_DIR"])] if os.environ.get("CARLSKIT_PLANETOID_DIR") else []
    return legacy + [folder / "planetoid" for folder in data_dirs()]


def fetch_command(name: str) -> str:
    """The command that gets Planetoid data set ``name`` (fetch for the published ones, convert for others)."""
    from carlskit.data._fetch import PLANETOID_SHA256

    if name not in PLANETOID_SHA256:
        return f"python -m carlskit.data convert planetoid {name} --raw FOLDER_WITH_ind.{name}.*"
    unpinned = " --unpinned" if PLANETOID_SHA256[name] is None else ""
    return f"python -m carlskit.data fetch planetoid {name}{unpinned}"


def planetoid_path(name: str) -> Path | None:
    """Where the converted Planetoid graph ``name`` (``"cora"``, ``"citeseer"``, ``"pubmed"``) lies,
    or ``None``: ``NAME.npz`` in ``$CARLSKIT_PLANETOID_DIR`` (kept for existing set-ups), then in
    ``planetoid/`` under each of :func:`data_dirs`."""
    for directory in _planetoid_dirs():
        path = directory / f"{name}.npz"
        if path.is_file():
            return path
    return None


def resolve_planetoid(name_or_path: str | os.PathLike) -> Path:
    """The ``.npz`` file a data set name or a path stands for; :class:`DatasetNotFoundError` (one line:
    what was tried and how to fetch it) when there is none."""
    text = os.fspath(name_or_path)
    path = Path(text)
    if path.is_file():
        return path
    if path.suffix == ".npz" or os.sep in text or "/" in text:
        known = planetoid_path(path.stem)
        hint = f"; the data set {path.stem!r} is at {known}: pass the name {path.stem!r}" if known else ""
        raise DatasetNotFoundError(f"no graph file {text!r} (expected a Planetoid-format .npz, or a data set name "
                                   f"such as 'cora'){hint}")
    found = planetoid_path(text)
    if found is None:
        tried = ", ".join(str(d / f"{text}.npz") for d in _planetoid_dirs())
        raise DatasetNotFoundError(f"Planetoid data set {text!r} not found (tried {tried}); "
                                   f"get it with: {fetch_command(text)}")
    return found


def load_planetoid(name_or_path: str | os.PathLike) -> Dataset:
    """Load a Planetoid-style graph by name (``"cora"``, ``"citeseer"``, a fetched ``"pubmed"``;
    see :func:`planetoid_path`) or from any ``.npz`` file in that format.

    The format (``data/planetoid/README.md``): float features [N, D], int labels [N] (-1 for
    unlabelled), int edges [M, 2], int index arrays ``train_idx``, ``val_idx``, ``test_idx``. Raises
    :class:`DatasetNotFoundError` when the name or path leads nowhere, ``ValueError`` naming the
    array when one is missing or has the wrong dtype, rank or range.
    """
    from carlskit._serialization import npz_bytes_to_arrays  # imports JAX: only when loading

    path = resolve_planetoid(name_or_path)
    archive = npz_bytes_to_arrays(path.read_bytes(), path)  # CorruptFileError naming the file if damaged
    arrays = {}
    for name, (kind, rank) in _PLANETOID_ARRAYS.items():
        if name not in archive:
            raise ValueError(f"{path.name}: missing array {name!r} (has {sorted(archive)})")
        array = archive[name]
        if not np.issubdtype(array.dtype, kind) or array.ndim != rank:
            raise ValueError(
                f"{path.name}: array {name!r} must be {kind.__name__} of rank {rank}, "
                f"got {array.dtype} with shape {array.shape}"
            )
        arrays[name] = array
    num_items = arrays["features"].shape[0]
    if arrays["labels"].shape != (num_items,):
        raise ValueError(f"{path.name}: labels must have shape ({num_items},), got {arrays['labels'].shape}")
    if arrays["edges"].shape[1:] != (2,):
        raise ValueError(f"{path.name}: edges must have shape [M, 2], got {arrays['edges'].shape}")
    for name in ("edges", "train_idx", "val_idx", "test_idx"):
        values = arrays[name]
        if values.size and (values.min() < 0 or values.max() >= num_items):
            raise ValueError(f"{path.name}: {name} holds ids outside [0, {num_items})")
    labels = arrays["labels"].astype(np.int64)
    return Dataset(
        name=path.stem,
        features=arrays["features"].astype(np.float32),
        labels=labels,
        train_idx=arrays["train_idx"].astype(np.int64),
        val_idx=arrays["val_idx"].astype(np.int64),
        test_idx=arrays["test_idx"].astype(np.int64),
        num_classes=int(labels.max()) + 1,
        edges=arrays["edges"].astype(np.int64),
    )


def neighbors_from_edges(edges: np.ndarray, num_items: int, max_neighbors: int,
                         *, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Fixed-width neighbour records from an undirected edge list.

    Returns ``ids`` [num_items, max_neighbors] int64 padded with -1 and ``weights`` float32 (1 for a
    neighbour, 0 for padding). Items with more neighbours keep a random subset (seeded).
    """
    edges = np.asarray(edges)
    if edges.ndim != 2 or edges.shape[1] != 2:
        raise ValueError(f"edges must have shape [M, 2], got {edges.shape}")
    if max_neighbors < 1:
        raise ValueError(f"max_neighbors must be >= 1, got {max_neighbors}")
    both = np.concatenate([edges, edges[:, ::-1]])
    both = both[both[:, 0] != both[:, 1]]
    rng = np.random.default_rng(seed)
    both = both[rng.permutation(len(both))]
    both = both[np.argsort(both[:, 0], kind="stable")]
    starts = np.searchsorted(both[:, 0], np.arange(num_items))
    rank = np.arange(len(both)) - starts[both[:, 0]]
    keep = rank < max_neighbors
    ids = np.full((num_items, max_neighbors), -1, dtype=np.int64)
    ids[both[keep, 0], rank[keep]] = both[keep, 1]
    weights = (ids >= 0).astype(np.float32)
    return ids, weights
