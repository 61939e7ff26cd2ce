"""Counter-based hashing used everywhere in the bank: routing, hash-map slots, initial values.

All functions are pure and vectorized over numpy arrays, so every shard, every client and every
restart computes the same numbers for the same key.
"""

from __future__ import annotations

import hashlib

import numpy as np

from carlskit._checks import utf8

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)

#: Salts so that shard routing, slot placement and initial values use independent hash streams.
ROUTING_SALT = 0
SLOT_SALT = 1
INIT_SALT = 2


def splitmix64(x: np.ndarray, salt: int = 0) -> np.ndarray:
    """splitmix64 finalizer of ``x + (salt + 1) * golden`` (uint64 in, uint64 out, wraps mod 2**64).

    z = x + c; z = (z ^ z >> 30) * 0xBF58476D1CE4E5B9; z = (z ^ z >> 27) * 0x94D049BB133111EB;
    return z ^ z >> 31  (Steele, Lea, Flood 2014).
    """
    z = np.asarray(x).astype(np.uint64, copy=True)
    z += np.uint64((salt + 1) * 0x9E3779B97F4A7C15 % (1 << 64))
    z ^= z >> _S30
    z *= _MIX1
    z ^= z >> _S27
    z *= _MIX2
    z ^= z >> _S31
    return z


def shard_of(keys: np.ndarray, num_shards: int) -> np.ndarray:
    """Shard index of each int64 key: ``splitmix64(key) mod num_shards`` (int64 array)."""
    if num_shards == 1:
        return np.zeros(len(keys), dtype=np.int64)
    return (splitmix64(keys.view(np.uint64), ROUTING_SALT) % np.uint64(num_shards)).astype(np.int64)


def key_from_string(names: str | list[str] | np.ndarray) -> np.ndarray:
    """Map strings to int64 keys: the first 8 bytes of blake2b(utf-8), read little-endian, top bit
    cleared (keys are then in [0, 2**63), so never the reserved -1). Collisions have probability
    about n**2 / 2**64."""
    if isinstance(names, str):
        names = [names]
    out = np.empty(len(names), dtype=np.int64)
    for i, name in enumerate(names):
        digest = hashlib.blake2b(utf8(str(name), "names"), digest_size=8).digest()
        out[i] = int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF
    return out


def _uniform_open01(bits: np.ndarray) -> np.ndarray:
    """Top 24 bits of a uint64 word -> float64 uniform in the open interval (0, 1)."""
    return ((bits >> np.uint64(40)).astype(np.float64) + 0.5) / float(1 << 24)


def initial_values(
    keys: np.ndarray, dim: int, initializer: str, seed: int, scale: float
) -> np.ndarray:
    """Deterministic initial rows for ``keys``: element j of key k depends only on (seed, k, j).

    h = splitmix64(k * dim + j) with a seed-dependent salt. ``uniform``: scale * (2u - 1) with u from
    the top 24 bits of h. ``normal``: Box-Muller, z = sqrt(-2 ln u1) cos(2 pi u2), with u1, u2 from
    two independent hashes, times ``scale``. ``zeros``: 0. Returns float32 [n, dim].
    """
    n = len(keys)
    if initializer == "zeros" or n == 0:
        return np.zeros((n, dim), dtype=np.float32)
    counters = keys.view(np.uint64)[:, None] * np.uint64(dim) + np.arange(dim, dtype=np.uint64)[None, :]
    salt = INIT_SALT + 4 * (int(seed) % (1 << 40))
    u1 = _uniform_open01(splitmix64(counters, salt))
    if initializer == "uniform":
        return (scale * (2.0 * u1 - 1.0)).astype(np.float32)
    u2 = _uniform_open01(splitmix64(counters, salt + 1))
    return (scale * np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)).astype(np.float32)
