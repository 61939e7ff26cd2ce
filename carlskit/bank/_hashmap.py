"""A vectorized bucketed hash map from int64 keys to int32 row indices (numpy only).

Slots are grouped in buckets of ``BUCKET`` (8) consecutive int64 keys, i.e. one 64-byte cache line;
a key lives in its home bucket ``mix(key) >> shift`` or, when that bucket is full, in the next
non-full bucket (linear probing over buckets). ``-1`` (the reserved "no key") marks an empty slot.
The table is kept at most half full, so a lookup of a batch costs one row gather of the home
buckets plus a compare: almost every key resolves in the first round, and the few that overflowed
take a second or third round on a tiny batch. There is no deletion (the bank never removes rows).
Measured (1M keys, 4096 random lookups): about 0.15 ms, vs about 1 ms for ``np.searchsorted`` on
sorted keys and about 0.3 ms for a linearly probed flat table.
"""

from __future__ import annotations

import numpy as np

BUCKET = 8
EMPTY = np.int64(-1)
_FIBONACCI = np.uint64(0x9E3779B97F4A7C15)
_S32 = np.uint64(32)


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
        rows = np.full(len(keys), -1, dtype=np.int64)
        num_buckets = len(self.bucket_fill)
        active = None  # None: every key, avoids copying on the first round
        buckets = self._home(keys)
        flat_rows = self.bucket_rows.reshape(-1)
        while True:
            probe_keys = keys if active is None else keys[active]
            window = self.bucket_keys.take(buckets, axis=0)
            hit = window == probe_keys[:, None]
            position = hit.argmax(axis=1)
            found = hit.view(np.uint64)[:, 0] != 0  # 8 bools = one word; faster than any(axis=1)
            found_rows = flat_rows.take(buckets * BUCKET + position)
            if active is None:
                rows[found] = found_rows[found]
            else:
                rows[active[found]] = found_rows[found]
            # a key may sit further on only when its bucket overflowed, i.e. it is full
            go_on = ~found & (self.bucket_fill.take(buckets) == BUCKET)
            if not go_on.any():
                return rows
            active = np.flatnonzero(go_on) if active is None else active[go_on]
            buckets = (buckets[go_on] + 1) % num_buckets

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
