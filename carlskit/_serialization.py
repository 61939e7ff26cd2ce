"""Pytrees to and from ``.npz`` bytes + JSON, atomically, on local disks or fsspec URLs. No pickle.

Every durable file in carlskit goes through :func:`atomic_write`: the bytes go to a temporary name
in the destination directory and are then renamed over the final name, so a reader sees either the
old file or the complete new one, never a half-written file.

Every byte is checksummed. JSON documents (manifests, evaluation state) are written by
:func:`dumps_checked_json` as ``{"format": "carlskit.checked-json/1", "sha256": H, "content": C}``
where ``H`` is the SHA-256 of ``C``'s canonical JSON (sorted keys, no spaces, no NaN/Infinity), so
the file stays strict, human-readable JSON and any change to a value fails :func:`loads_checked_json`;
the reader also requires the exact bytes its writer produces, so a change that parses to the same
value (a float's 17th digit, whitespace) is refused too: every byte is checked.
Array files (``.npz``) carry zip's CRC-32 per member, and manifests record the SHA-256 of the whole
file (:func:`sha256_hex`), checked before it is parsed. Every failure is a
:class:`carlskit.CorruptFileError` naming the file, whatever layer (JSON, zip, zlib) noticed it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import struct
import threading
import uuid
import zipfile
import zlib
from typing import Any

import fsspec
import fsspec.implementations.local
import numpy as np

from carlskit._errors import CorruptFileError

CHECKED_JSON_FORMAT = "carlskit.checked-json/1"

# numpy parses every .npy header with ``ast.literal_eval``. On CPython 3.11 the AST constructor's
# recursion counter is shared by all threads of the interpreter (python/cpython#106905): when a
# garbage collection runs a finalizer mid-construction and another thread parses a header meanwhile,
# one of them raises ``SystemError: AST constructor recursion depth mismatch``. Maker slices in
# one Dask worker load checkpoints from several threads at once, so every .npy/.npz read in carlskit
# holds this lock (reads are milliseconds; decoding, not I/O, is what it serializes).
NUMPY_READ_LOCK = threading.Lock()

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
    """An uncompressed ``.npz`` of ``arrays``; object arrays are refused (no pickle is ever written)."""
    buffer = io.BytesIO()
    np.savez(buffer, allow_pickle=False, **arrays)
    return buffer.getvalue()


def npz_bytes_to_arrays(data: bytes, path: str | os.PathLike = "<bytes>",
                        sha256: str | None = None) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` file's bytes; :class:`CorruptFileError` naming ``path`` when damaged.

    With ``sha256`` (as recorded in a manifest), the bytes are checked against it first.
    """
    if sha256 is not None and sha256_hex(data) != sha256:
        raise CorruptFileError(path, "SHA-256 differs from the one its manifest records")
    try:
        with NUMPY_READ_LOCK, np.load(io.BytesIO(data), allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except (zipfile.BadZipFile, zlib.error, EOFError, RuntimeError, NotImplementedError, KeyError,
            ValueError, OSError) as error:
        # zipfile reports damage as any of these (a bad CRC is BadZipFile, a bad compression method
        # NotImplementedError, an encrypted flag RuntimeError, a cut header EOFError or ValueError).
        raise CorruptFileError(path, f"unreadable .npz: {type(error).__name__}: {error}") from error


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# A zip archive ends with its end-of-central-directory record (22 bytes, the last two the length of
# the archive's comment) and then the comment. The seal is that comment: ``SEAL_PREFIX`` and the hex
# SHA-256 of every byte before the digest (the zip entries, the central directory, the record with
# its comment length, the prefix). zip's own CRC-32s cover only the members' data, so a flip in a
# local header or the central directory can leave an archive that still reads; the seal cannot.
SEAL_PREFIX = b"carlskit-sha256:"
_SEAL_DIGEST_LENGTH = 64
_EOCD = struct.Struct("<4s4H2LH")  # signature, disk numbers, entry counts, sizes, comment length
_EOCD_SIGNATURE = b"PK\x05\x06"


def seal_zip(data: bytes) -> bytes:
    """``data`` (a zip archive with no comment, as :func:`arrays_to_npz_bytes` writes) sealed: its
    comment set to ``SEAL_PREFIX`` + the SHA-256 of every byte before the digest. Still a valid
    ``.npz`` for ``np.load`` and any zip tool."""
    record = _EOCD.unpack(data[-_EOCD.size:])
    if record[0] != _EOCD_SIGNATURE or record[-1] != 0:
        raise ValueError("seal_zip needs a zip archive without a comment")
    comment_length = len(SEAL_PREFIX) + _SEAL_DIGEST_LENGTH
    body = data[:-2] + struct.pack("<H", comment_length) + SEAL_PREFIX
    return body + sha256_hex(body).encode()


def is_sealed(data: bytes) -> bool:
    """Whether ``data`` ends like a :func:`seal_zip` archive (the seal is not checked: :func:`check_seal`)."""
    return data[-_SEAL_DIGEST_LENGTH - len(SEAL_PREFIX):-_SEAL_DIGEST_LENGTH] == SEAL_PREFIX


def check_seal(data: bytes, path: str | os.PathLike = "<bytes>") -> None:
    """Raise :class:`CorruptFileError` naming ``path`` unless ``data`` is a :func:`seal_zip` archive
    whose every byte matches its seal."""
    if not is_sealed(data):
        raise CorruptFileError(path, "no carlskit SHA-256 seal at the end of the archive")
    body, digest = data[:-_SEAL_DIGEST_LENGTH], data[-_SEAL_DIGEST_LENGTH:]
    if sha256_hex(body).encode() != digest:
        raise CorruptFileError(path, "bytes do not match the SHA-256 seal at the end of the archive")


def _canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def dumps_checked_json(content: Any) -> bytes:
    """``content`` as strict, indented JSON wrapped with the SHA-256 of its canonical form.

    Raises ``ValueError`` for values JSON cannot hold exactly (NaN, infinities, non-str keys).
    """
    digest = sha256_hex(_canonical_json(content))
    document = {"format": CHECKED_JSON_FORMAT, "sha256": digest, "content": content}
    return json.dumps(document, indent=1, sort_keys=True, allow_nan=False).encode()


def loads_checked_json(data: bytes, path: str | os.PathLike = "<bytes>") -> Any:
    """The content of a :func:`dumps_checked_json` document, after checking its checksum.

    Raises :class:`CorruptFileError` naming ``path`` when the bytes are not such a document (not
    UTF-8, not JSON, no checksum, another format) or the content does not match its SHA-256.
    """
    def reject_constant(name: str) -> Any:
        raise ValueError(f"non-standard JSON constant {name}")

    try:
        document = json.loads(bytes(data).decode("utf-8"), parse_constant=reject_constant)
    except (UnicodeDecodeError, ValueError) as error:
        raise CorruptFileError(path, f"not valid JSON: {error}") from error
    if not isinstance(document, dict) or document.get("format") != CHECKED_JSON_FORMAT:
        raise CorruptFileError(path, f"not a checksummed carlskit JSON document ({CHECKED_JSON_FORMAT})")
    if set(document) != {"format", "sha256", "content"} or not isinstance(document["sha256"], str):
        raise CorruptFileError(path, "checksummed JSON document has unexpected fields")
    if sha256_hex(_canonical_json(document["content"])) != document["sha256"]:
        raise CorruptFileError(path, "content does not match its SHA-256")
    if dumps_checked_json(document["content"]) != bytes(data):
        # The checksum covers the parsed content; a float's 17th digit (or whitespace) can change
        # without changing it. The writer's bytes are canonical, so any other byte is damage too.
        raise CorruptFileError(path, "bytes differ from the canonical form its writer produced (e.g. a "
                                     "float digit or whitespace that does not change the parsed value)")
    return document["content"]


def flatten_pytree(tree: Any) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Leaves of ``tree`` by their key path, as numpy arrays, plus the key impl of PRNG-key leaves.

    Typed PRNG keys (``jax.random.key``) are stored as their raw key data; the returned dict of
    ``{name: impl}`` lets :func:`unflatten_into` wrap them back.
    """
    import jax  # here, not at import: the data loaders and command lines use this module without JAX

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
    import jax

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
