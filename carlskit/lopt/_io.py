"""Meta-parameters on disk without pickle: ONE ``.npz`` holding the arrays and a JSON description.

Layout of ``<name>.npz`` (``format_version`` 4): entries ``leaf_0 .. leaf_{n-1}`` (the meta-parameter
arrays, real floating dtypes) and ``__carlskit__``, a ``uint8`` array holding the checksummed JSON
document (:func:`carlskit._serialization.dumps_checked_json`) of
``{"format_version": 4, "structure": ..., "config": ..., "leaves": {"leaf_<i>": [dtype, shape, sha256]}}``.
``structure`` describes the nested dicts/lists with leaves named ``"leaf:<i>"``; ``config`` is the
caller's JSON (rule, horizon, info); ``leaves`` records each array's dtype, shape and the SHA-256 of
its bytes. The archive is then sealed (:func:`carlskit._serialization.seal_zip`): its zip comment is the
SHA-256 of every byte before it, so every byte is checked, the zip container (local headers, central
directory) included, and checked first; the description's own SHA-256 and the SHA-256 it records for
each array catch a file re-written and re-sealed by a buggy writer.
Any damage, whichever layer notices it (zip, zlib, JSON, checksum, structure), raises
:class:`carlskit.CorruptFileError` (a ``ValueError``) naming the file.

Older files are still read, with a warning to re-save them: ``format_version`` 3 (the same layout,
unsealed: the container's headers are unchecked) and 2 (a plain, unchecksummed JSON description).
A format-4 description in an unsealed file is damage (a flip broke the seal), never a format-3 file.

Everything is serialized and checked in memory first; then the bytes go to a temporary sibling which
is renamed over the target (``os.replace``, atomic). A failing save leaves the previous file as it was
and no temporary file; a reader sees the old file or the new one, never a mix.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import warnings
from typing import Any

import jax
import numpy as np

from carlskit._checks import path as check_path
from carlskit._errors import CorruptFileError
from carlskit._serialization import (
    arrays_to_npz_bytes,
    atomic_write,
    check_seal,
    dumps_checked_json,
    filesystem,
    is_sealed,
    loads_checked_json,
    npz_bytes_to_arrays,
    seal_zip,
    sha256_hex,
)

FORMAT_VERSION = 4
UNSEALED_FORMAT_VERSION = 3  # checksummed description and arrays, unsealed container: still read
LEGACY_FORMAT_VERSION = 2  # plain JSON description, no checksums: still read
DESCRIPTION_ENTRY = "__carlskit__"
SUFFIX = ".npz"
ZIP_MAGIC = b"PK\x03\x04"  # every .npz starts with a zip local file header


def meta_params_file(path: str | os.PathLike) -> pathlib.Path:
    """The file ``save_meta_params(path, ...)`` writes: ``path`` if it ends in ``.npz``, else ``path + '.npz'``.

    The suffix is appended, never substituted, so ``"lopt.v1"`` and ``"lopt.v2"`` are different files.
    """
    name = os.fspath(check_path(path, "path"))
    if not isinstance(name, str):
        raise TypeError(f"path must be a str or os.PathLike naming a file, got {path!r}")
    return pathlib.Path(name if name.endswith(SUFFIX) else name + SUFFIX)


# ---------------------------------------------------------------------------------------- checking
def _key_path(prefix: str, key: Any) -> str:
    return f"{prefix}[{key!r}]"


def _check_json(value: Any, where: str) -> None:
    """Raise naming ``where`` (e.g. ``config['info']['loss']``) unless ``value`` is plain, finite JSON."""
    if value is None or isinstance(value, (bool, str)):
        return
    if isinstance(value, float):  # includes np.float64, a float subclass
        if type(value) is not float:
            raise TypeError(f"{where}: {type(value).__name__} is not a plain JSON value; use float(...)")
        if not math.isfinite(value):
            raise ValueError(f"{where}: {value!r} is not a finite number (JSON has no NaN/Infinity)")
        return
    if isinstance(value, int):
        if type(value) is not int:
            raise TypeError(f"{where}: {type(value).__name__} is not a plain JSON value; use int(...)")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where}: key {key!r} is not a str (JSON object keys are strings)")
            _check_json(item, _key_path(where, key))
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_json(item, f"{where}[{index}]")
        return
    raise TypeError(f"{where}: {type(value).__name__} is not JSON-serializable "
                    "(use dict, list, str, int, float, bool or None)")


def _flatten(meta_params: Any) -> tuple[Any, dict[str, np.ndarray]]:
    """``(structure, {"leaf_<i>": array})`` of nested dicts (str keys) / lists of real floating arrays."""
    arrays: dict[str, np.ndarray] = {}

    def walk(node: Any, where: str) -> Any:
        if isinstance(node, dict):
            for key in node:
                if not isinstance(key, str):
                    raise TypeError(f"{where}: key {key!r} is not a str")
            return {"dict": {key: walk(node[key], _key_path(where, key)) for key in sorted(node)}}
        if isinstance(node, (list, tuple)):
            return {"list": [walk(item, f"{where}[{index}]") for index, item in enumerate(node)]}
        if not isinstance(node, (np.ndarray, np.generic, jax.Array, float)) or isinstance(node, bool):
            raise TypeError(f"{where}: leaf of type {type(node).__name__}; expected a floating array")
        array = np.asarray(node)
        if not np.issubdtype(array.dtype, np.floating):
            raise TypeError(f"{where}: dtype {array.dtype}; meta-parameters must have a real floating dtype")
        if not np.all(np.isfinite(array)):
            raise ValueError(f"{where}: holds NaN or infinite values")
        name = f"leaf_{len(arrays)}"
        arrays[name] = array
        return name.replace("_", ":")

    return walk(meta_params, "meta_params"), arrays


def _leaf_record(array: np.ndarray) -> list:
    """``[dtype, shape, sha256]`` of one array: what the description promises about its entry."""
    array = np.ascontiguousarray(array)
    return [array.dtype.str, list(array.shape), sha256_hex(array.tobytes())]


# ---------------------------------------------------------------------------------------- writing
def save_meta_params(path: str | os.PathLike, meta_params: Any, config: dict[str, Any]) -> pathlib.Path:
    """Write ``meta_params`` and the JSON ``config`` to one ``.npz``, atomically; returns the file written.

    The file is ``meta_params_file(path)``. Raises ``TypeError``/``ValueError`` naming the offending
    leaf or config key (non-floating or non-finite arrays, values JSON cannot hold exactly) before
    anything is written.
    """
    target = meta_params_file(path)
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict, got {type(config).__name__}")
    _check_json(config, "config")
    structure, arrays = _flatten(meta_params)
    document = {"format_version": FORMAT_VERSION, "structure": structure, "config": config,
                "leaves": {name: _leaf_record(array) for name, array in arrays.items()}}
    description = dumps_checked_json(document)
    arrays[DESCRIPTION_ENTRY] = np.frombuffer(description, np.uint8)
    data = seal_zip(arrays_to_npz_bytes(arrays))
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(*filesystem(target), data)
    return target


# ---------------------------------------------------------------------------------------- reading
def _corrupt(file: pathlib.Path, problem: str) -> CorruptFileError:
    return CorruptFileError(file, f"not an intact carlskit learned-optimizer file: {problem}")


def _rebuild(file: pathlib.Path, structure: Any, arrays: dict[str, np.ndarray], used: set[str]) -> Any:
    if isinstance(structure, str):
        name = structure.replace(":", "_")
        if not structure.startswith("leaf:") or name not in arrays:
            raise _corrupt(file, f"structure names leaf {structure!r}, which the file does not hold")
        if name in used:
            raise _corrupt(file, f"structure names leaf {structure!r} twice")
        used.add(name)
        return arrays[name]
    if isinstance(structure, dict) and len(structure) == 1:
        if isinstance(structure.get("dict"), dict):
            return {key: _rebuild(file, value, arrays, used) for key, value in structure["dict"].items()}
        if isinstance(structure.get("list"), list):
            return [_rebuild(file, value, arrays, used) for value in structure["list"]]
    raise _corrupt(file, f"bad structure node {json.dumps(structure)[:80]}")


def _description(file: pathlib.Path, raw: bytes, sealed: bool) -> dict:
    """The description document: checksummed (format 4 in a sealed file, 3 in an unsealed one, warned),
    or a legacy plain one (format 2, warned)."""
    try:
        plain = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as err:
        raise _corrupt(file, f"bad JSON description: {err}") from err
    if isinstance(plain, dict) and plain.get("format_version") == LEGACY_FORMAT_VERSION:
        warnings.warn(f"{file}: learned-optimizer file of format_version {LEGACY_FORMAT_VERSION} has no "
                      "checksums; re-save it to add them", UserWarning, stacklevel=4)
        return plain
    if isinstance(plain, dict) and "format_version" in plain:
        raise _corrupt(file, f"format_version {plain['format_version']!r}, this reader reads {FORMAT_VERSION} "
                             f"(and {UNSEALED_FORMAT_VERSION}, {LEGACY_FORMAT_VERSION})")
    try:
        document = loads_checked_json(raw, file)
    except CorruptFileError as err:
        raise _corrupt(file, f"JSON description: {err.problem}") from err
    if not isinstance(document, dict):
        raise _corrupt(file, f"JSON description is a {type(document).__name__}, expected an object")
    version = document.get("format_version")
    if version == FORMAT_VERSION and not sealed:
        raise _corrupt(file, f"format_version {FORMAT_VERSION} file without its SHA-256 seal")
    if version == UNSEALED_FORMAT_VERSION and not sealed:
        warnings.warn(f"{file}: learned-optimizer file of format_version {UNSEALED_FORMAT_VERSION} has no "
                      "SHA-256 seal over its zip container; re-save it to add one", UserWarning, stacklevel=4)
        return document
    if version != FORMAT_VERSION:
        raise _corrupt(file, f"format_version {version!r}, this reader reads {FORMAT_VERSION} (sealed) and "
                             f"{UNSEALED_FORMAT_VERSION} (unsealed)")
    return document


def _reject_constant(name: str) -> None:
    raise ValueError(f"non-standard JSON constant {name}")


def load_meta_params(path: str | os.PathLike) -> tuple[Any, dict[str, Any]]:
    """Inverse of ``save_meta_params``: ``(meta_params, config)``, arrays as ``jnp`` arrays.

    ``path`` may be given with or without ``.npz``. Missing file: ``FileNotFoundError``; anything
    damaged (truncated, bit flips in arrays or JSON, zip-level damage, missing entries, leaves not
    matching the structure or their recorded SHA-256): :class:`carlskit.CorruptFileError` (a
    ``ValueError``) naming the file and the problem.
    """
    file = meta_params_file(path)
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no such learned-optimizer file")
    return meta_params_from_bytes(file.read_bytes(), file)


def meta_params_from_bytes(data: bytes, file: pathlib.Path) -> tuple[Any, dict[str, Any]]:
    """:func:`load_meta_params` of the bytes ``data`` read from ``file`` (named in errors)."""
    if data[:len(ZIP_MAGIC)] != ZIP_MAGIC:
        raise _corrupt(file, "empty file" if not data else "not an .npz (zip) archive")
    sealed = is_sealed(data)
    if sealed:  # before any parsing: every byte, container included
        try:
            check_seal(data, file)
        except CorruptFileError as err:
            raise _corrupt(file, err.problem) from err
    try:
        arrays = npz_bytes_to_arrays(data, file)
    except CorruptFileError as err:  # zip, zlib, npy header, pickle refusal...: all mean a bad file
        raise _corrupt(file, err.problem) from err

    raw = arrays.pop(DESCRIPTION_ENTRY, None)
    if raw is None:
        raise _corrupt(file, f"no {DESCRIPTION_ENTRY!r} entry; files of the old two-file layout "
                             "(.npz + .json) are not read any more")
    if raw.dtype != np.uint8 or raw.ndim != 1:
        raise _corrupt(file, f"{DESCRIPTION_ENTRY!r} is {raw.dtype}{list(raw.shape)}, expected 1-D uint8")
    document = _description(file, raw.tobytes(), sealed)
    missing = {"format_version", "structure", "config"} - set(document)
    if missing:
        raise _corrupt(file, f"JSON description lacks {sorted(missing)}")
    if not isinstance(document["config"], dict):
        raise _corrupt(file, f"config is a {type(document['config']).__name__}, expected an object")
    if document["format_version"] in (FORMAT_VERSION, UNSEALED_FORMAT_VERSION):
        leaves = document.get("leaves")
        if not isinstance(leaves, dict) or set(leaves) != set(arrays):
            listed = sorted(leaves) if isinstance(leaves, dict) else leaves
            raise _corrupt(file, f"entries {sorted(arrays)[:5]} do not match the recorded leaves {str(listed)[:80]}")
        for name in sorted(arrays):
            if _leaf_record(arrays[name]) != leaves[name]:
                raise _corrupt(file, f"entry {name!r} differs from its recorded dtype, shape or SHA-256")

    used: set[str] = set()
    tree = _rebuild(file, document["structure"], arrays, used)
    unlisted = sorted(set(arrays) - used)
    if unlisted:
        raise _corrupt(file, f"entries {unlisted[:5]} not listed in the structure")
    for name in sorted(used):
        if not np.issubdtype(arrays[name].dtype, np.floating):
            raise _corrupt(file, f"entry {name!r} has dtype {arrays[name].dtype}, expected floating")
    return jax.tree.map(jax.numpy.asarray, tree), document["config"]
