"""Meta-parameters on disk without pickle: ``<path>.npz`` (arrays) + ``<path>.json`` (structure, config).

Both files are written to temporary names then moved into place with ``os.replace`` (atomic), the
arrays first, so a reader sees either the old pair or the new one.
"""

from __future__ import annotations

import json
import os
import pathlib
import tempfile
from typing import Any

import jax
import numpy as np

FORMAT_VERSION = 1


def _base(path: str | os.PathLike) -> pathlib.Path:
    path = pathlib.Path(path)
    return path.with_suffix("") if path.suffix in (".npz", ".json") else path


def _atomic_write(target: pathlib.Path, write) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the usual file mode
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _structure(tree: Any) -> Any:
    """JSON description of nested dicts / lists of arrays; leaves become ``'leaf:<i>'``."""
    counter = iter(range(1 << 30))

    def walk(node):
        if isinstance(node, dict):
            return {"dict": {str(k): walk(v) for k, v in sorted(node.items())}}
        if isinstance(node, (list, tuple)):
            return {"list": [walk(v) for v in node]}
        return f"leaf:{next(counter)}"

    return walk(tree)


def _rebuild(structure: Any, arrays: dict[str, np.ndarray]) -> Any:
    if isinstance(structure, str):
        return arrays[structure.replace(":", "_")]
    if "dict" in structure:
        return {k: _rebuild(v, arrays) for k, v in structure["dict"].items()}
    return [_rebuild(v, arrays) for v in structure["list"]]


def save_meta_params(path: str | os.PathLike, meta_params: Any, config: dict[str, Any]) -> pathlib.Path:
    """Write ``meta_params`` (nested dicts/lists of arrays) and a JSON ``config``; returns the base path."""
    base = _base(path)
    structure = _structure(meta_params)
    leaves = jax.tree.leaves(meta_params)
    arrays = {f"leaf_{i}": np.asarray(leaf) for i, leaf in enumerate(leaves)}
    _atomic_write(base.with_suffix(".npz"), lambda handle: np.savez(handle, **arrays))
    document = {"format_version": FORMAT_VERSION, "structure": structure, "config": config}
    _atomic_write(base.with_suffix(".json"), lambda handle: handle.write(json.dumps(document, indent=1).encode()))
    return base


def load_meta_params(path: str | os.PathLike) -> tuple[Any, dict[str, Any]]:
    """Inverse of ``save_meta_params``: returns ``(meta_params, config)`` (arrays as ``jnp`` arrays)."""
    base = _base(path)
    if not base.with_suffix(".json").exists() or not base.with_suffix(".npz").exists():
        raise FileNotFoundError(f"path: expected {base}.json and {base}.npz")
    document = json.loads(base.with_suffix(".json").read_text())
    if document.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"path: unsupported format_version {document.get('format_version')!r}")
    with np.load(base.with_suffix(".npz"), allow_pickle=False) as data:
        arrays = {k: data[k] for k in data.files}
    meta_params = jax.tree.map(jax.numpy.asarray, _rebuild(document["structure"], arrays))
    return meta_params, document["config"]
