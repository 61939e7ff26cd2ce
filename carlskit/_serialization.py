"""Pytrees to and from ``.npz`` bytes + JSON, atomically, on local disks or fsspec URLs. No pickle.

Every durable file in carlskit goes through :func:`atomic_write`: the bytes go to a temporary name
in the destination directory and are then renamed over the final name, so a reader sees either the
old file or the complete new one, never a half-written file.
"""

from __future__ import annotations

import io
import json
import os
import uuid
from typing import Any

import fsspec
import fsspec.implementations.local
import jax
import numpy as np


def filesystem(path: str | os.PathLike) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem and the path within it for a local path or a URL like ``memory://x``."""
    return fsspec.core.url_to_fs(os.fspath(path))


def atomic_write(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary sibling and a rename (fsync'd on local disks)."""
    directory, name = path.rsplit("/", 1) if "/" in path else ("", path)
    temporary = f"{directory}/.tmp-{uuid.uuid4().hex}-{name}" if directory else f".tmp-{uuid.uuid4().hex}-{name}"
    local = isinstance(fs, fsspec.implementations.local.LocalFileSystem)
    try:
        with fs.open(temporary, "wb") as handle:
            handle.write(data)
            if local:  # on disk before the rename publishes it
                handle.flush()
                os.fsync(handle.fileno())
        if local:
            os.replace(temporary, path)  # atomic on POSIX
        else:
            fs.mv(temporary, path)
    except BaseException:
        if fs.exists(temporary):
            fs.rm(temporary)
        raise


def arrays_to_npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def npz_bytes_to_arrays(data: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(data), allow_pickle=False) as archive:
        return {name: archive[name] for name in archive.files}


def flatten_pytree(tree: Any) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Leaves of ``tree`` by their key path, as numpy arrays, plus the key impl of PRNG-key leaves.

    Typed PRNG keys (``jax.random.key``) are stored as their raw key data; the returned dict of
    ``{name: impl}`` lets :func:`unflatten_into` wrap them back.
    """
    arrays, key_impls = {}, {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = jax.tree_util.keystr(path)
        if name in arrays:
            raise ValueError(f"two leaves share the key path {name!r}")
        if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            key_impls[name] = str(jax.random.key_impl(leaf))
            leaf = jax.random.key_data(leaf)
        arrays[name] = np.asarray(leaf)
    return arrays, key_impls


def unflatten_into(target: Any, arrays: dict[str, np.ndarray], key_impls: dict[str, str]) -> Any:
    """A pytree with ``target``'s structure whose leaves are ``arrays`` matched by key path.

    Raises ``ValueError`` naming the leaves that are missing or whose shape or dtype differ.
    """
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(target)
    names = [jax.tree_util.keystr(path) for path, _ in leaves_with_paths]
    missing = [name for name in names if name not in arrays]
    extra = sorted(set(arrays) - set(names))
    if missing or extra:
        raise ValueError(f"checkpoint does not match the target: missing {missing[:5]}, unexpected {extra[:5]}")
    leaves = []
    for name, (_, template) in zip(names, leaves_with_paths):
        value = arrays[name]
        if name in key_impls:
            leaves.append(jax.random.wrap_key_data(value, impl=key_impls[name]))
            continue
        template_shape = np.shape(template)
        if tuple(value.shape) != tuple(template_shape):
            raise ValueError(f"leaf {name!r}: checkpoint shape {value.shape} != target shape {template_shape}")
        template_dtype = getattr(template, "dtype", None)
        if template_dtype is not None and np.dtype(template_dtype) != value.dtype:
            raise ValueError(f"leaf {name!r}: checkpoint dtype {value.dtype} != target dtype {template_dtype}")
        leaves.append(jax.numpy.asarray(value) if isinstance(template, jax.Array) else value)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def dumps_json(obj: Any) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=True).encode()
