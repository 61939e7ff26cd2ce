"""Versioned checkpoints of pytrees (Flax NNX state, optax state) in a directory or fsspec URL.

Layout: ``v{version:012d}.npz`` (leaves by key path) and ``v{version:012d}.json`` (manifest:
version, wall time, leaf names, PRNG key impls, user metadata). The manifest is written last and
atomically, so a checkpoint exists exactly when its manifest does: readers (makers, evaluation
chiefs) never see a half-written checkpoint. No pickle anywhere.
"""

from __future__ import annotations

import json
import os
import re
import time
import zipfile
from typing import Any

import jax.numpy as jnp
import numpy as np

from carlskit._serialization import (
    arrays_to_npz_bytes,
    atomic_write,
    dumps_json,
    filesystem,
    flatten_pytree,
    npz_bytes_to_arrays,
    unflatten_into,
)
from carlskit._checks import positive_int

_MANIFEST = re.compile(r"^v(\d{12})\.json$")


class CheckpointStore:
    """Publish and read versioned checkpoints; keep the newest ``keep`` of them.

    Example::

        store = CheckpointStore("runs/cora/checkpoints", keep=3)
        store.save({"model": nnx.state(model), "optimizer": nnx.state(optimizer)}, version=step)
        version = store.latest()
        tree, metadata = store.load(version, target={"model": nnx.state(model), ...})
    """

    def __init__(self, path: str | os.PathLike, *, keep: int | None = 5):
        if keep is not None:
            keep = positive_int(keep, "keep (or None)")
        self.path = os.fspath(path)
        self.keep = keep
        self._fs, self._root = filesystem(self.path)
        self._fs.makedirs(self._root, exist_ok=True)

    def __repr__(self) -> str:
        return f"CheckpointStore({self.path!r}, keep={self.keep}, versions={self.versions()})"

    def _file(self, version: int, suffix: str) -> str:
        return f"{self._root}/v{version:012d}.{suffix}"

    def versions(self) -> list[int]:
        """Published versions, oldest first."""
        names = (entry.rsplit("/", 1)[-1] for entry in self._fs.ls(self._root, detail=False))
        return sorted(int(match.group(1)) for name in names if (match := _MANIFEST.match(name)))

    def latest(self) -> int | None:
        """The newest published version, or ``None`` when there is none."""
        versions = self.versions()
        return versions[-1] if versions else None

    def save(self, tree: Any, *, version: int, metadata: dict | None = None) -> int:
        """Publish ``tree`` (any pytree of arrays) as ``version``; returns the version.

        Raises ``ValueError`` if ``version`` is negative or not newer than the latest one, and
        ``TypeError`` for a leaf that is not an array of numbers, bools or strings (it would need
        pickle) or metadata that is not a JSON-serializable dict; nothing is written then.
        """
        if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
            raise ValueError(f"version must be a non-negative int, got {version!r}")
        if metadata is not None and not isinstance(metadata, dict):
            raise TypeError(f"metadata must be a dict or None, got {type(metadata).__name__}")
        version = int(version)
        latest = self.latest()
        if latest is not None and version <= latest:
            raise ValueError(f"version {version} is not newer than the latest checkpoint {latest}")
        arrays, key_impls = flatten_pytree(tree)
        objects = [name for name, leaf in arrays.items() if leaf.dtype.kind == "O"]
        if objects:  # np.savez would pickle them, and load (allow_pickle=False) could never read them
            raise TypeError(f"checkpoint leaves must be arrays of numbers, bools or strings; leaves "
                            f"{sorted(objects)[:5]} are object arrays (e.g. None or a Python object inside)")
        manifest = {
            "format": "carlskit-checkpoint/1",
            "version": version,
            "wall_time": time.time(),
            "leaves": {name: [str(a.dtype), list(a.shape)] for name, a in arrays.items()},
            "key_impls": key_impls,
            "metadata": metadata or {},
        }
        try:
            manifest_bytes = dumps_json(manifest)  # before writing anything: no orphan .npz
        except (TypeError, ValueError) as error:
            raise TypeError(f"metadata must be JSON-serializable: {error}") from error
        atomic_write(self._fs, self._file(version, "npz"), arrays_to_npz_bytes(arrays))
        atomic_write(self._fs, self._file(version, "json"), manifest_bytes)
        self._prune()
        return version

    def _prune(self) -> None:
        if self.keep is None:
            return
        for version in self.versions()[: -self.keep]:
            self._fs.rm(self._file(version, "json"))  # manifest first: the checkpoint disappears atomically
            if self._fs.exists(self._file(version, "npz")):
                self._fs.rm(self._file(version, "npz"))

    def manifest(self, version: int | None = None) -> dict:
        """The JSON manifest of ``version`` (default: latest)."""
        version = self._resolve(version)
        with self._fs.open(self._file(version, "json"), "rb") as handle:
            data = handle.read()
        try:
            manifest = json.loads(data)
            if not isinstance(manifest, dict):
                raise ValueError(f"a JSON {type(manifest).__name__}, not an object")
        except ValueError as error:  # JSONDecodeError is a ValueError
            raise self._corrupt(version, "json", error) from error
        return manifest

    def _corrupt(self, version: int, suffix: str, error: BaseException) -> ValueError:
        return ValueError(f"checkpoint version {version} is corrupt: {self._file(version, suffix)} "
                          f"({type(error).__name__}: {error})")

    def _resolve(self, version: int | None) -> int:
        if version is None:
            version = self.latest()
            if version is None:
                raise FileNotFoundError(f"no checkpoint in {self.path!r}")
        elif version not in self.versions():
            raise FileNotFoundError(f"no checkpoint version {version} in {self.path!r} (have {self.versions()})")
        return version

    def load(self, version: int | None = None, *, target: Any = None) -> tuple[Any, dict]:
        """Read ``version`` (default: latest). Returns ``(tree, metadata)``.

        With ``target`` (a pytree of the same structure, e.g. ``nnx.state(model)``) the leaves are
        put into that structure, checked for shape and dtype; without, ``tree`` is a flat dict of
        numpy arrays keyed by leaf path.
        """
        version = self._resolve(version)
        manifest = self.manifest(version)
        with self._fs.open(self._file(version, "npz"), "rb") as handle:
            data = handle.read()
        try:
            arrays = npz_bytes_to_arrays(data)
            for name, (dtype, _) in manifest["leaves"].items():
                if arrays[name].dtype.kind == "V":  # bfloat16 & co. are written as raw bytes by np.savez
                    arrays[name] = arrays[name].view(jnp.dtype(dtype))
            if set(arrays) != set(manifest["leaves"]):
                raise ValueError(f"arrays {sorted(set(arrays) ^ set(manifest['leaves']))} are in only one "
                                 f"of the .npz and the manifest")
            key_impls, extra = manifest["key_impls"], {"version": version, "wall_time": manifest["wall_time"]}
            metadata = manifest["metadata"]
        except (ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as error:
            raise self._corrupt(version, "npz", error) from error
        tree = arrays if target is None else unflatten_into(target, arrays, key_impls)
        return tree, {**metadata, **extra, "key_impls": key_impls}


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
