"""A vectorized bucketed hash map from int64 keys to int32 row indices (numpy only).

Slots are grouped in buckets of ``BUCKET`` (8) consecutive int64 keys, i.e. one 64-byte cache line;
a key lives in its home bucket ``mix(key) >> shift`` or, when that bucket is full, in the next
non-full bucket (linear probing over buckets). ``-1`` (the reserved "no key") marks an empty slot.
The table is kept at most half full, so a lookup of a batch costs one row gather of the home
buckets plus a compare: almost every key resolves in the first round, and the few that overflowed
take a second or third round on a tiny batch. There is no deletion (the bank never removes rows).
A key's slot in its bucket is read off the compare's 8 bytes as one word (a bit count), not by
an ``argmax``; the ~2% of keys past their home bucket are compared with the next 4 buckets at once.
Measured (1M keys, 4096 random lookups, quiet 2-core machine): about 0.10 ms (0.15 ms with an argmax
and a bucket per round), vs about 1 ms for ``np.searchsorted`` on sorted keys and about 0.3 ms for a
linearly probed flat table.
"""

from __future__ import annotations

import sys

import numpy as np

BUCKET = 8
EMPTY = np.int64(-1)
_FIBONACCI = np.uint64(0x9E3779B97F4A7C15)
_S32 = np.uint64(32)
_SPAN_STEPS = np.arange(1, 5)  # overflowing keys: the next 4 buckets in one compare


if sys.byteorder == "little":
    def _slot_of(word: np.ndarray, hit: np.ndarray) -> np.ndarray:
        """The slot (0..7) of each bucket's hit: its one true byte is byte ``p`` of the little-endian
        word ``1 << 8p``, so ``word - 1`` has ``8p`` bits set (a bucket without a hit reads 8,
        masked by the caller). A tenth of the time of ``hit.argmax(axis=1)``."""
        return np.bitwise_count(word - np.uint64(1)) >> 3
else:  # pragma: no cover - no big-endian CI machine
    def _slot_of(word: np.ndarray, hit: np.ndarray) -> np.ndarray:
        return hit.argmax(axis=1)


class Int64RowMap:
    """key (int64, never -1) -> row (int32, dense 0..len-1 in insertion order)."""

    def __init__(self, capacity: int = 1024) -> None:
        self.size = 0
        self._allocate(self._buckets_for(capacity))

    @classmethod
    def restored(cls, bucket_keys: np.ndarray, bucket_rows: np.ndarray, bucket_fill: np.ndarray,
                 size: int) -> "Int64RowMap":
        """The map whose bucket arrays were saved in a snapshot part (loaded without rehashing)."""
        self = cls.__new__(cls)
        self.bucket_keys, self.bucket_rows, self.bucket_fill = bucket_keys, bucket_rows, bucket_fill
        self.shift = np.uint64(64 - (len(bucket_fill).bit_length() - 1))
        self.size = size
        return self

    @staticmethod
    def _buckets_for(capacity: int) -> int:
        num_buckets = 4
        while num_buckets * BUCKET < 2 * capacity:
            num_buckets *= 2
        return num_buckets

    def _allocate(self, num_buckets: int) -> None:
        self.bucket_keys = np.full((num_buckets, BUCKET), EMPTY, dtype=np.int64)
        self.bucket_rows = np.empty((num_buckets, BUCKET), dtype=np.int32)
        self.bucket_fill = np.zeros(num_buckets, dtype=np.int16)
        self.shift = np.uint64(64 - (num_buckets.bit_length() - 1))

    def __len__(self) -> int:
        return self.size

    @property
    def nbytes(self) -> int:
        return self.bucket_keys.nbytes + self.bucket_rows.nbytes + self.bucket_fill.nbytes

    def _home(self, keys: np.ndarray) -> np.ndarray:
        """Home bucket: Fibonacci hashing of ``k ^ (k >> 32)`` (top bits of the product)."""
        x = keys.view(np.uint64)
        return (((x ^ (x >> _S32)) * _FIBONACCI) >> self.shift).astype(np.int64)

    def get(self, keys: np.ndarray) -> np.ndarray:
        """Rows of ``keys`` (int64 [n]); -1 where absent."""
        flat_rows = self.bucket_rows.reshape(-1)
        buckets = self._home(keys)
        hit = self.bucket_keys.take(buckets, axis=0) == keys[:, None]
        word = hit.view(np.uint64)[:, 0]  # a bucket's 8 compare results as one word
        rows = flat_rows.take(buckets * BUCKET + _slot_of(word, hit), mode="clip").astype(np.int64)
        found = word != 0
        if found.all():
            return rows
        # the few keys not in their home bucket (about 2% at half full): absent, or further on, which
        # a key can be only when every bucket from its home to it is full (linear probing). They are
        # compared with the next SPAN buckets at once (chains are short), then the next SPAN, ...
        active = np.flatnonzero(~found)
        rows[active] = -1
        buckets = buckets[active]
        num_buckets = len(self.bucket_fill)
        while True:
            full = self.bucket_fill.take(buckets) == BUCKET  # the last bucket looked at overflowed
            active, buckets = active[full], buckets[full]
            if not len(active):
                return rows
            span = (buckets[:, None] + _SPAN_STEPS) % num_buckets  # [m, SPAN]
            hit = self.bucket_keys.take(span, axis=0) == keys[active][:, None, None]  # [m, SPAN, BUCKET]
            flat_hit = hit.reshape(len(active), -1)
            found = flat_hit.any(axis=1)
            slot = flat_hit[found].argmax(axis=1)  # bucket-major: SPAN * BUCKET positions
            rows[active[found]] = flat_rows.take(span[found, slot // BUCKET] * BUCKET + slot % BUCKET)
            active, buckets = active[~found], span[~found, -1]

    def insert_new(self, keys: np.ndarray) -> np.ndarray:
        """Insert distinct keys known to be absent; returns their new rows (size, size+1, ...)."""
        n = len(keys)
        rows = np.arange(self.size, self.size + n, dtype=np.int64)
        if n == 0:
            return rows
        if 2 * (self.size + n) > self.bucket_keys.size:
            self._grow(self.size + n)
        self._place(keys, rows.astype(np.int32))
        self.size += n
        return rows

    def _place(self, keys: np.ndarray, rows: np.ndarray) -> None:
        num_buckets = len(self.bucket_fill)
        buckets = self._home(keys)
        while len(keys):
            order = np.argsort(buckets, kind="stable")
            sorted_buckets = buckets[order]
            group_start = np.flatnonzero(np.r_[True, sorted_buckets[1:] != sorted_buckets[:-1]])
            group_size = np.diff(np.r_[group_start, len(order)])
            rank = np.arange(len(order)) - np.repeat(group_start, group_size)
            slot = self.bucket_fill[sorted_buckets].astype(np.int64) + rank
            fits = slot < BUCKET
            placed = order[fits]
            self.bucket_keys[sorted_buckets[fits], slot[fits]] = keys[placed]
            self.bucket_rows[sorted_buckets[fits], slot[fits]] = rows[placed]
            first_of_group = sorted_buckets[group_start]
            self.bucket_fill[first_of_group] = np.minimum(
                self.bucket_fill[first_of_group] + group_size, BUCKET
            ).astype(np.int16)
            left = order[~fits]
            keys, rows = keys[left], rows[left]
            buckets = (buckets[left] + 1) % num_buckets

    def _grow(self, min_size: int) -> None:
        occupied = self.bucket_keys != EMPTY
        keys, rows = self.bucket_keys[occupied], self.bucket_rows[occupied]
        self._allocate(self._buckets_for(min_size))
        self._place(keys, rows)
