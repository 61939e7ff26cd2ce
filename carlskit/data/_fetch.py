"""Downloading the original Planetoid files with pinned SHA-256 sums, then converting them.

The canonical public location is the Planetoid repository itself (the URL every graph library
uses). The sums below were computed from the files as published at commit af6abf4 (the copies in
``data/planetoid/raw/``, byte for byte). PubMed's are not pinned yet: nobody has verified a
download of it for this project, so :func:`fetch_planetoid` refuses it unless ``allow_unpinned``
(``--unpinned``), and then prints the sums it saw so that they can be pinned here. Even unpinned
files cannot run code: they are read through the restricted unpickler of ``_planetoid``.
"""

from __future__ import annotations

import hashlib
import io
import os
import sys
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import numpy as np

from carlskit._errors import CorruptFileError
from carlskit._serialization import NUMPY_READ_LOCK
from carlskit.data._planetoid import PLANETOID_SUFFIXES, raw_file, read_planetoid_raw

PLANETOID_URL = "https://github.com/kimiyoung/planetoid/raw/master/data"

#: The pinned SHA-256 sum of every raw Planetoid file, per data set (``None``: not pinned yet, so a
#: fetch needs ``allow_unpinned``).
PLANETOID_SHA256: dict[str, dict[str, str] | None] = {
    "cora": {
        "x": "23cfa55d91c6f624233f5eb7b6e3f141f1bd2b2ae39608a63cf5d084bb27baab",
        "y": "94465c14eb53e04ca262198dcbb2521ee8af60fb3f3d546cd6ca24a511b0e7d1",
        "tx": "b9afbaa4a400df991f6f02ef677e1e44da55ffc04801fd02f9e673987829226a",
        "ty": "41f5ac76596a1699cc33f53084a2419e92961c42bb75f36fc38e616d348532ad",
        "allx": "9419ba2f26f5c35243db64aba110e0f35a04851609e0dc5433450676ca6b8543",
        "ally": "2b998f5cc7fedc86e7f97ca2498f47a1ffc1462c29e2d578b23bf3f62b6e7d71",
        "graph": "58f13302f39dde8852dad6fe6d15b89b077b6d7f837626bce671ef80344b383d",
        "test.index": "297ce89af2b51a6a194181c7dbe1796c6a1cf9cd9349a88383b1b1e227867875",
    },
    "citeseer": {
        "x": "d20de19150741e555de0ed037195630fc194114ebc7fd72ced62810148aa22f6",
        "y": "8ba87e515d8e3ee3cf52f6d2c5b86aa73f11ecad825a808455209ec26cd54924",
        "tx": "539a8906a2da97628d212f2fdd668c109a8b3f0d36574b59e5d3fd5b5303da21",
        "ty": "55e5bd1ba1e733a04598753ad1a8d57957f4b8f89e74519f41f4f4938767e4ce",
        "allx": "2ac30345d95c9ec933a817ee0bdd6a5f077f8c184a20e696910192d534414668",
        "ally": "f704b2d986dde6c2669934de1f3ae5696a6cf9455c0f6b2646a2d135ea0a1c95",
        "graph": "d79a4ef9d3e7169aee8946145f6b7306e35bc79bffad26346cfb94e10e9912a7",
        "test.index": "2af990671580b6b2df5d158d1038f8292e30c9cd821b5453f399659b25b723d4",
    },
    # Not pinned: to be filled in from the first verified download (run with --unpinned, compare the
    # printed sums with another source, e.g. a second network, and paste them here).
    "pubmed": None,
}


class UnpinnedDatasetError(ValueError):
    """The data set has no pinned sums and ``allow_unpinned`` was not given."""

    def __init__(self, name: str):
        self.name = name
        super().__init__(f"{name}: no SHA-256 sums are pinned in carlskit for this data set yet, so its download "
                         f"cannot be verified; pass allow_unpinned=True to accept it unverified")


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download(url: str, target: Path, sha256: str | None, *, progress: bool = True, timeout: float = 60.0) -> str:
    """Stream ``url`` into ``target`` (through a temporary sibling renamed on success) and return its
    SHA-256; :class:`CorruptFileError` naming the URL, with nothing written, when ``sha256`` is given
    and differs. ``OSError`` (``urllib.error.URLError``) when the download fails."""
    from tqdm.auto import tqdm

    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".part-{os.getpid()}-{target.name}")
    digest = hashlib.sha256()
    try:
        try:
            response = urllib.request.urlopen(url, timeout=timeout)
        except (urllib.error.URLError, TimeoutError) as error:
            raise OSError(f"could not download {url}: {getattr(error, 'reason', error)}") from error
        with response, open(temporary, "wb") as handle:
            total = response.headers.get("Content-Length")
            with tqdm(total=int(total) if total else None, unit="B", unit_scale=True, desc=target.name,
                      file=sys.stderr, disable=not progress, leave=False) as bar:
                for block in iter(lambda: response.read(1 << 16), b""):
                    handle.write(block)
                    digest.update(block)
                    bar.update(len(block))
            handle.flush()
            os.fsync(handle.fileno())
        got = digest.hexdigest()
        if sha256 is not None and got != sha256:
            raise CorruptFileError(url, f"SHA-256 {got} differs from the pinned {sha256}; nothing was kept")
        os.replace(temporary, target)
        return got
    finally:
        if temporary.exists():
            temporary.unlink()


def fetch_planetoid(name: str, directory: str | os.PathLike | None = None, *, base_url: str = PLANETOID_URL,
                    allow_unpinned: bool = False, progress: bool = True) -> Path:
    """Download Planetoid data set ``name``'s eight files into ``directory/raw`` (default: the
    ``planetoid`` folder of :func:`carlskit.data.data_dir`), check their pinned SHA-256 sums, and
    convert them to ``directory/NAME.npz``; returns that path.

    Files already present with the pinned sum are not downloaded again. ``base_url`` replaces the
    Planetoid repository (a mirror, or a local server in tests). Raises ``ValueError`` for an unknown
    name, :class:`UnpinnedDatasetError` for one without pinned sums unless ``allow_unpinned``, and
    :class:`CorruptFileError` when a download does not match its sum.
    """
    from carlskit.data._datasets import data_dir

    if name not in PLANETOID_SHA256:
        raise ValueError(f"name: unknown Planetoid data set {name!r}; known: {', '.join(PLANETOID_SHA256)}")
    sums = PLANETOID_SHA256[name]
    if sums is None and not allow_unpinned:
        raise UnpinnedDatasetError(name)
    directory = Path(directory) if directory is not None else data_dir() / "planetoid"
    seen = {}
    for suffix in PLANETOID_SUFFIXES:
        target = raw_file(directory / "raw", name, suffix)
        expected = None if sums is None else sums[suffix]
        if expected is not None and target.is_file() and _sha256_file(target) == expected:
            continue
        seen[suffix] = download(f"{base_url.rstrip('/')}/{target.name}", target, expected, progress=progress)
    if sums is None:
        print(f"{name}: downloaded UNVERIFIED (no pinned sums); to pin them, add to PLANETOID_SHA256 in "
              f"carlskit/data/_fetch.py: {seen!r}", file=sys.stderr)
    output = directory / f"{name}.npz"
    arrays = _convert(name, directory / "raw", output)
    if progress:
        labelled = int(np.sum(arrays["labels"] >= 0))
        print(f"{name}: {len(arrays['features'])} nodes, {len(arrays['edges'])} edges, {labelled} labelled "
              f"-> {output}", file=sys.stderr)
    return output


def convert_planetoid(name: str, raw_directory: str | os.PathLike, output: str | os.PathLike) -> Path:
    """Convert the eight original files ``ind.NAME.*`` in ``raw_directory`` to the ``.npz`` at ``output``
    (written atomically), as :func:`fetch_planetoid` does after a download."""
    _convert(name, raw_directory, output)
    return Path(output)


def _convert(name: str, raw_directory: str | os.PathLike, output: str | os.PathLike) -> dict[str, np.ndarray]:
    from carlskit._serialization import atomic_write, filesystem

    arrays = read_planetoid_raw(raw_directory, name)
    if _holds(output, arrays):  # leave an identical file alone (a zip's timestamps would change its bytes)
        return arrays
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)  # 0/1 bag-of-words: Cora's 15 MB of float32 zip to 0.15 MB
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    fs, path = filesystem(output)
    atomic_write(fs, path, buffer.getvalue())
    return arrays


def _holds(path: str | os.PathLike, arrays: dict[str, np.ndarray]) -> bool:
    """Whether the .npz at ``path`` exists and holds exactly ``arrays`` (names, dtypes, values)."""
    try:
        with NUMPY_READ_LOCK, np.load(path, allow_pickle=False) as existing:
            return sorted(existing.files) == sorted(arrays) and all(
                existing[k].dtype == v.dtype and np.array_equal(existing[k], v) for k, v in arrays.items())
    except (OSError, ValueError, EOFError, zipfile.BadZipFile):
        return False
