"""Versioned checkpoints of pytrees (Flax NNX state, optax state) in a directory or fsspec URL.

Layout: ``v{version:012d}.npz`` (leaves by key path) and ``v{version:012d}.json`` (manifest:
version, wall time, leaf names, PRNG key impls, user metadata, and the SHA-256 and size of the
``.npz``). The manifest is a checksummed JSON document (:func:`carlskit._serialization.dumps_checked_json`)
written last and atomically, so a checkpoint exists exactly when its manifest does: readers (makers,
evaluation chiefs) never see a half-written checkpoint. No pickle anywhere.

Every read verifies every byte: the manifest's own SHA-256, then the ``.npz``'s SHA-256 recorded in
the manifest, then the zip structure. Any damage raises :class:`carlskit.CorruptFileError` naming the
file; nothing of a damaged checkpoint is ever returned. Readers of the series (``latest()``,
``load_latest()``, the trainer's resume, makers) fall back to the newest *intact* version. Manifests
written before checksums existed (format ``carlskit-checkpoint/1``) are refused the same way: their
contents cannot be told apart from a damaged copy.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from carlskit._checks import instance, integer, positive_int
from carlskit._checks import path as check_path
from carlskit._errors import CorruptFileError
from carlskit._serialization import (
    arrays_to_npz_bytes,
    atomic_write,
    dumps_checked_json,
    filesystem,
    flatten_pytree,
    loads_checked_json,
    npz_bytes_to_arrays,
    sha256_hex,
    unflatten_into,
)

_MANIFEST = re.compile(r"^v(\d{12})\.json$")
FORMAT = "carlskit-checkpoint/2"
_LEGACY_FORMAT = "carlskit-checkpoint/1"
_MANIFEST_FIELDS = {"format", "version", "wall_time", "leaves", "key_impls", "metadata", "npz_sha256", "npz_bytes"}


class CheckpointStore:
    """Publish and read versioned checkpoints; keep the newest ``keep`` intact ones.

    Example::

        store = CheckpointStore("runs/cora/checkpoints", keep=3)
        store.save({"model": nnx.state(model), "optimizer": nnx.state(optimizer)}, version=step)
        version = store.latest()                      # newest intact version
        tree, metadata = store.load(version, target={"model": nnx.state(model), ...})

    ``corrupt`` maps each damaged version this store has seen to the reason (see
    :meth:`corrupt_versions`); a version is checked once per content of its manifest, so a reader
    polling the series never re-reads a damaged checkpoint, and one rewritten by ``save`` is checked
    again.
    """

    def __init__(self, path: str | os.PathLike, *, keep: int | None = 5):
        if keep is not None:
            keep = positive_int(keep, "keep (or None)")
        self.path = os.fspath(check_path(path, "path"))
        self.keep = keep
        self._fs, self._root = filesystem(self.path)
        self._fs.makedirs(self._root, exist_ok=True)
        # version -> (SHA-256 of its manifest's bytes, None if intact or the reason it is not);
        # only published versions are kept (bounded by the store's size).
        self._checked: dict[int, tuple[str, str | None]] = {}
        self._forget_above = 64
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"CheckpointStore({self.path!r}, keep={self.keep}, versions={self.versions()})"

    def __getstate__(self):  # shipped to Dask workers by makers and evaluation chiefs
        return {"path": self.path, "keep": self.keep}

    def __setstate__(self, state):
        self.__init__(state["path"], keep=state["keep"])

    def _file(self, version: int, suffix: str) -> str:
        return f"{self._root}/v{version:012d}.{suffix}"

    def file(self, version: int, suffix: str = "json") -> str:
        """Path of ``version``'s manifest (``"json"``) or arrays (``"npz"``), e.g. for error messages."""
        return self._file(version, suffix)

    def versions(self) -> list[int]:
        """Published versions (intact or not), oldest first."""
        names = (entry.rsplit("/", 1)[-1] for entry in self._fs.ls(self._root, detail=False))
        return sorted(int(match.group(1)) for name in names if (match := _MANIFEST.match(name)))

    def latest(self) -> int | None:
        """The newest *intact* version (manifest and arrays pass their checksums), or ``None``.

        Damaged newer versions are skipped and recorded in :meth:`corrupt_versions`. Each version's
        arrays are hashed once per store object (and again only if its manifest changes).
        """
        for version in reversed(self.versions()):
            if self.verify(version) is None:
                return version
        return None

    def verify(self, version: int) -> str | None:
        """``None`` when ``version`` is intact, else why not (a missing version raises
        ``FileNotFoundError``). Reads the arrays only the first time a manifest is seen."""
        try:
            manifest_bytes = self._read(version, "json")
        except FileNotFoundError:
            raise FileNotFoundError(f"no checkpoint version {version} in {self.path!r}") from None
        digest = sha256_hex(manifest_bytes)
        known = self._checked.get(version)
        if known is not None and known[0] == digest:
            return known[1]
        try:
            manifest = self._parse_manifest(version, manifest_bytes)
            self._arrays(version, manifest)
            reason = None
        except CorruptFileError as error:
            reason = str(error)
        self._remember(version, digest, reason)
        return reason

    def _known_damaged(self, version: int) -> bool:
        with self._lock:
            known = self._checked.get(version)
        return known is not None and known[1] is not None and known[0] == sha256_hex(self._read(version, "json"))

    def corrupt_versions(self) -> dict[int, str]:
        """``{version: reason}`` of the published versions found damaged so far (by any read)."""
        published = set(self.versions())
        with self._lock:
            return {v: reason for v, (_, reason) in sorted(self._checked.items()) if reason and v in published}

    def _remember(self, version: int, digest: str, reason: str | None) -> None:
        with self._lock:
            self._checked[version] = (digest, reason)
            if len(self._checked) > self._forget_above:  # forget versions no longer published
                published = set(self.versions())
                for stale in [v for v in self._checked if v not in published]:
                    del self._checked[stale]
                self._forget_above = 2 * len(self._checked) + 64  # amortized: one listing per doubling

    def save(self, tree: Any, *, version: int, metadata: dict | None = None, check_finite: bool = False) -> int:
        """Publish ``tree`` (any pytree of arrays) as ``version``; returns the version.

        Raises ``ValueError`` if ``version`` is negative or not newer than the latest intact one
        (a damaged version is overwritten when saved again), or, with ``check_finite``, when a
        floating-point leaf holds NaN or an infinity (named); ``TypeError`` for a leaf that is not an
        array of numbers, bools or strings (it would need pickle) or metadata that is not a
        JSON-serializable dict. Nothing is written then.
        """
        version = integer(version, "version", 0)
        if metadata is not None:
            instance(metadata, "metadata", dict, "a dict or None")
        latest = self.latest()
        if latest is not None and version <= latest:
            raise ValueError(f"version {version} is not newer than the latest checkpoint {latest}")
        arrays, key_impls = flatten_pytree(tree)
        objects = [name for name, leaf in arrays.items() if leaf.dtype.kind == "O"]
        if objects:  # np.savez would pickle them, and load (allow_pickle=False) could never read them
            raise TypeError(f"checkpoint leaves must be arrays of numbers, bools or strings; leaves "
                            f"{sorted(objects)[:5]} are object arrays (e.g. None or a Python object inside)")
        if check_finite:
            bad = non_finite_leaves(arrays)
            if bad:
                raise ValueError(f"checkpoint version {version} not saved: leaves {bad[:5]} hold NaN or "
                                 "infinite values")
        data = arrays_to_npz_bytes(arrays)
        manifest = {
            "format": FORMAT,
            "version": version,
            "wall_time": time.time(),
            "leaves": {name: [str(a.dtype), list(a.shape)] for name, a in arrays.items()},
            "key_impls": key_impls,
            "metadata": metadata or {},
            "npz_sha256": sha256_hex(data),
            "npz_bytes": len(data),
        }
        try:
            manifest_bytes = dumps_checked_json(manifest)  # before writing anything: no orphan .npz
        except (TypeError, ValueError) as error:
            raise TypeError(f"metadata must be JSON-serializable: {error}") from error
        atomic_write(self._fs, self._file(version, "npz"), data)
        atomic_write(self._fs, self._file(version, "json"), manifest_bytes)
        self._remember(version, sha256_hex(manifest_bytes), None)
        self._prune()
        return version

    def _prune(self) -> None:
        """Keep the newest ``keep`` intact versions (and any damaged version newer than them)."""
        if self.keep is None:
            return
        versions, intact = self.versions(), 0
        for index in range(len(versions) - 1, -1, -1):
            intact += self.verify(versions[index]) is None
            if intact == self.keep:
                break
        else:
            return
        for version in versions[:index]:
            self._fs.rm(self._file(version, "json"))  # manifest first: the checkpoint disappears atomically
            if self._fs.exists(self._file(version, "npz")):
                self._fs.rm(self._file(version, "npz"))

    def _read(self, version: int, suffix: str) -> bytes:
        with self._fs.open(self._file(version, suffix), "rb") as handle:
            return handle.read()

    def _parse_manifest(self, version: int, data: bytes) -> dict:
        path = self._file(version, "json")
        try:
            manifest = loads_checked_json(data, path)
        except CorruptFileError:
            if _legacy_manifest(data):
                raise CorruptFileError(path, f"a {_LEGACY_FORMAT} manifest without a checksum: its contents "
                                             f"cannot be verified, so it is refused (re-save the checkpoint)") from None
            raise
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise CorruptFileError(path, f"not a {FORMAT} manifest")
        if set(manifest) != _MANIFEST_FIELDS:
            raise CorruptFileError(path, f"manifest fields {sorted(set(manifest) ^ _MANIFEST_FIELDS)} "
                                         f"differ from {FORMAT}'s")
        if manifest["version"] != version:
            raise CorruptFileError(path, f"manifest of version {manifest['version']} "
                                         f"under the name of version {version}")
        return manifest

    def _arrays(self, version: int, manifest: dict) -> dict[str, np.ndarray]:
        path = self._file(version, "npz")
        try:
            data = self._read(version, "npz")
        except FileNotFoundError:
            raise CorruptFileError(path, "the arrays of a published manifest are missing") from None
        if len(data) != manifest["npz_bytes"]:
            raise CorruptFileError(path, f"{len(data)} bytes, its manifest records {manifest['npz_bytes']}")
        arrays = npz_bytes_to_arrays(data, path, sha256=manifest["npz_sha256"])
        if set(arrays) != set(manifest["leaves"]):
            raise CorruptFileError(path, f"arrays {sorted(set(arrays) ^ set(manifest['leaves']))} are in only one "
                                         f"of the .npz and the manifest")
        for name, (dtype, shape) in manifest["leaves"].items():
            if arrays[name].dtype.kind == "V":  # bfloat16 & co. are written as raw bytes by np.savez
                arrays[name] = arrays[name].view(jnp.dtype(dtype))
            if str(arrays[name].dtype) != dtype or list(arrays[name].shape) != shape:
                raise CorruptFileError(path, f"leaf {name!r} is {arrays[name].dtype} {arrays[name].shape}, "
                                             f"its manifest records {dtype} {tuple(shape)}")
        return arrays

    def manifest(self, version: int | None = None) -> dict:
        """The verified manifest of ``version`` (default: the latest intact one)."""
        version = self._resolve(version)
        return self._parse_manifest(version, self._read(version, "json"))

    def _resolve(self, version: int | None) -> int:
        if version is None:
            version = self.latest()
            if version is None:
                damaged = self.corrupt_versions()
                raise FileNotFoundError(f"no intact checkpoint in {self.path!r}"
                                        + (f" (damaged: {damaged})" if damaged else ""))
        elif version not in self.versions():
            raise FileNotFoundError(f"no checkpoint version {version} in {self.path!r} (have {self.versions()})")
        return version

    def load(self, version: int | None = None, *, target: Any = None) -> tuple[Any, dict]:
        """Read ``version`` (default: the latest intact one). Returns ``(tree, metadata)``.

        With ``target`` (a pytree of the same structure, e.g. ``nnx.state(model)``) the leaves are
        put into that structure, checked for shape and dtype; without, ``tree`` is a flat dict of
        numpy arrays keyed by leaf path. Raises :class:`carlskit.CorruptFileError` naming the file
        when any byte of the checkpoint is damaged, ``FileNotFoundError`` when it does not exist.
        """
        version = self._resolve(version)
        try:
            manifest_bytes = self._read(version, "json")
        except FileNotFoundError:  # pruned since _resolve
            raise FileNotFoundError(f"no checkpoint version {version} in {self.path!r}") from None
        digest = sha256_hex(manifest_bytes)
        try:
            manifest = self._parse_manifest(version, manifest_bytes)
            arrays = self._arrays(version, manifest)
        except CorruptFileError as error:
            self._remember(version, digest, str(error))
            raise
        self._remember(version, digest, None)
        key_impls = manifest["key_impls"]
        tree = arrays if target is None else unflatten_into(target, arrays, key_impls)
        extra = {"version": version, "wall_time": manifest["wall_time"]}
        return tree, {**manifest["metadata"], **extra, "key_impls": key_impls}

    def load_latest(self, *, target: Any = None, newer_than: int | None = None,
                    on_skip: Callable[[int, str], None] | None = None) -> tuple[int, Any, dict] | None:
        """``(version, tree, metadata)`` of the newest intact version (newer than ``newer_than``), or
        ``None`` when there is none. Damaged versions are skipped (see :meth:`corrupt_versions`) and
        read once per manifest content: ``on_skip(version, reason)`` is called when one is found
        damaged. A version pruned while it was read is skipped too."""
        for version in reversed(self.versions()):
            if newer_than is not None and version <= newer_than:
                return None
            try:
                if self._known_damaged(version):
                    continue  # found damaged before and its manifest is unchanged: not read again
                tree, metadata = self.load(version, target=target)
            except CorruptFileError as error:
                if on_skip is not None:
                    on_skip(version, str(error))
                continue
            except FileNotFoundError:  # pruned while we read it
                continue
            return version, tree, metadata
        return None


def non_finite_leaves(arrays: dict[str, Any]) -> list[str]:
    """Names of the floating-point leaves of a flat ``{name: array}`` that hold NaN or +-inf."""
    bad = []
    for name, leaf in arrays.items():
        leaf = np.asarray(leaf)
        if (jnp.issubdtype(leaf.dtype, jnp.inexact)
                and not np.isfinite(leaf.astype(np.complex128 if leaf.dtype.kind == "c" else np.float64)).all()):
            bad.append(name)
    return bad


def _legacy_manifest(data: bytes) -> bool:
    import json

    try:
        document = json.loads(data)
    except ValueError:
        return False
    return isinstance(document, dict) and document.get("format") == _LEGACY_FORMAT


def restore_model(model, arrays: dict[str, np.ndarray], metadata: dict, prefix: str = "model") -> None:
    """Put the ``prefix`` subtree of a flat checkpoint (``CheckpointStore.load`` without target) into
    a Flax NNX ``model`` in place, e.g. a maker's copy of the trainer's model."""
    from flax import nnx

    head = f"[{prefix!r}]"
    subset = {name[len(head):]: a for name, a in arrays.items() if name.startswith(head)}
    impls = {name[len(head):]: i for name, i in metadata.get("key_impls", {}).items() if name.startswith(head)}
    if not subset:
        raise ValueError(f"the checkpoint has no subtree {prefix!r}")
    nnx.update(model, unflatten_into(nnx.state(model), subset, impls))
