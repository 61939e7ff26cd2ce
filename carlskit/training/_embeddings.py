"""Embedding tables that live in the bank and are trained through it (CARLS 3.2, "embedding lookup
and update"; the design of TF Recommenders-Addons ``dynamic_embedding`` and TorchRec).

Three parts, one per place the work happens:

- :class:`BankEmbeddings` is a knowledge stage of the trainer's input pipeline: for each batch it
  dedupes the ids of the fields that read each table, looks their rows up in the bank in one
  batched call per table (missing keys created by the table's initializer, ``insert_missing``), and
  adds ``bank_rows/<table>`` [U, dim] float32 (U: the distinct ids' count rounded up to a power of
  two, at most the batch's ids, so the step compiles a few times at most; rows past the distinct
  ids are zeros and their gradients are not sent) and ``bank_index/<field>``
  (each id's row, the field's shape). It runs in the prefetch thread, ahead of the step.
- :class:`BankEmbedding` is the model's module: it holds the name of the table it reads and its
  dim, and gathers ``bank_rows/<table>[bank_index/<field>]`` inside the jitted step.
- The trainer's step differentiates the loss with respect to every ``bank_rows/*`` input as well as
  the model's ``nnx.Param`` variables: the gradient of a distinct row is the sum of the gradients of
  every use of its id in the batch. The trainer sends these with ``apply_gradients_async`` (the
  table's own optimizer, SGD or Adagrad, with its state next to the rows in the shard; the lazy
  averaging options are the table's) without waiting for the answer.

Staleness: a lookup for batch ``n`` waits until the gradients of steps before ``n - max_staleness``
were acknowledged by the bank. ``max_staleness=0`` is synchronous training (each step reads rows
that hold every earlier step's gradient: equal to an ``nnx.Embed`` trained by optax); 1 (default)
lets the lookup of the next batch overlap the current step, as Monolith and CARLS do.
"""

from __future__ import annotations

import collections
import secrets
import threading
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx

from carlskit._checks import integer
from carlskit._step import BANK_ROWS as ROWS
from carlskit.bank import ShardLostError
from carlskit.training._pipeline import Batch

INDEX = "bank_index/"
_KEYS = "_bank_keys/"  # host-side: the distinct ids of each table's rows (not sent to the step)
_WAIT_SECONDS = 0.05


def padded_rows(distinct: int, total: int) -> int:
    """Rows sent to the step for ``distinct`` ids among ``total``: the next power of two (at least
    8), at most ``total``, so the step compiles a handful of times whatever the batch's repeats,
    and a batch of a few hot ids moves few rows."""
    return min(total, max(8, 1 << max(distinct - 1, 0).bit_length()))


def rows_name(table: str) -> str:
    return ROWS + table


def index_name(field: str) -> str:
    return INDEX + field


class BankEmbedding(nnx.Module):
    """An embedding whose table lives in the bank: ``BankEmbedding("nodes", 128)(batch, "center")``.

    Holds no parameters: the rows of the batch's ids arrive in the batch (``bank_rows/<table>``,
    written by :class:`BankEmbeddings`) and their gradients go back to the bank. ``table`` names the
    bank table it reads; ``dim`` is checked against that table when the trainer starts.
    """

    def __init__(self, table: str, dim: int):
        if not isinstance(table, str) or not table:
            raise TypeError(f"table must be a bank table name (a non-empty str), got {table!r}")
        self.table = table
        self.dim = integer(dim, "dim", minimum=1)

    def __call__(self, batch: Batch, field: str) -> Any:
        """The rows of ``batch[field]``'s ids: ``[*field's shape, dim]``."""
        rows, index = batch.get(rows_name(self.table)), batch.get(index_name(field))
        if rows is None or index is None:
            raise ValueError(f"BankEmbedding({self.table!r}) reads batch[{rows_name(self.table)!r}] and "
                             f"batch[{index_name(field)!r}]: list {field!r} under table {self.table!r} in the "
                             f"trainer's BankEmbeddings stage")
        if rows.shape[-1] != self.dim:
            raise ValueError(f"BankEmbedding({self.table!r}) has dim {self.dim}, the batch's rows have "
                             f"dim {rows.shape[-1]}")
        return jnp.take(rows, index, axis=0)


def bank_embeddings_of(model: nnx.Module) -> list[BankEmbedding]:
    """Every :class:`BankEmbedding` inside ``model``."""
    return [node for _, node in nnx.iter_graph(model) if isinstance(node, BankEmbedding)]


class BankEmbeddings:
    """The input-pipeline stage that reads bank embedding rows for a batch (module docstring).

    Args:
      bank: a :class:`carlskit.KnowledgeBank`.
      tables: ``{table: [field, ...]}``: the batch fields whose int ids read each embedding table
        (e.g. ``{"nodes": ["center"], "contexts": ["context", "negatives"]}``); a field may have any
        shape.
      num_ids: ``{table: n}`` (optional): ids of that table must lie in ``[0, n)`` (a vocabulary);
        without it any id ``>= 0`` is a key (a dynamic table, e.g. hashed 63-bit ids).
      max_staleness: steps whose gradients a lookup may miss (0: synchronous; module docstring).
      knowledge: another stage run first (e.g. :class:`NeighborKnowledge`).

    Bad ids (a float dtype, negative, beyond ``num_ids``, a field missing) raise TypeError/ValueError
    naming the field before anything is sent: no row is created.
    """

    def __init__(self, bank: Any, tables: dict[str, list[str]], *, num_ids: dict[str, int] | None = None,
                 max_staleness: int = 1, knowledge: Callable[[Batch], Batch] | None = None):
        if not isinstance(tables, dict) or not tables:
            raise ValueError(f"tables must be a non-empty dict {{table: [field, ...]}}, got {tables!r}")
        clean: dict[str, tuple[str, ...]] = {}
        seen: set[str] = set()
        for table, fields in tables.items():
            bank.table_config(table, "embedding")
            fields = (fields,) if isinstance(fields, str) else tuple(fields)
            if not fields or not all(isinstance(f, str) and f for f in fields):
                raise ValueError(f"tables[{table!r}] must be a non-empty list of batch field names, got {fields!r}")
            if seen & set(fields):
                raise ValueError(f"fields {sorted(seen & set(fields))} read two tables; each field reads one")
            seen |= set(fields)
            clean[table] = fields
        num_ids = dict(num_ids or {})
        for table, n in num_ids.items():
            if table not in clean:
                raise ValueError(f"num_ids names {table!r}, which is not among tables {sorted(clean)}")
            num_ids[table] = integer(n, f"num_ids[{table!r}]", minimum=1)
        if knowledge is not None and not callable(knowledge):
            raise TypeError(f"knowledge must be callable as knowledge(batch) -> batch, got {type(knowledge).__name__}")
        self.bank = bank
        self.tables = clean
        self.num_ids = num_ids
        self.max_staleness = integer(max_staleness, "max_staleness", minimum=0)
        self.knowledge = knowledge
        self.dims = {table: bank.table_config(table).dim for table in clean}
        self.resent_gradients = 0  # re-sent after a lost shard (module docstring of _send_again)
        self._init_sync()

    def _init_sync(self) -> None:
        self._cond = threading.Condition()
        self._looked_up = 0  # batches looked up since begin()
        self._pushed = 0  # steps whose gradients the bank acknowledged since begin()
        self._in_flight: collections.deque = collections.deque()
        self._closed = False
        # gradients a lost shard never acknowledged: (table, keys, gradients, push id)
        self._resend: list[tuple[str, np.ndarray, np.ndarray, int]] = []

    def __getstate__(self) -> dict:  # travels to a worker with Trainer.fit(client=...)
        state = dict(self.__dict__)
        for name in ("_cond", "_in_flight", "_looked_up", "_pushed", "_closed", "_resend"):
            state.pop(name)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_sync()

    # -- checks ------------------------------------------------------------------------------------
    def check_model(self, model: nnx.Module) -> None:
        """ValueError unless every :class:`BankEmbedding` of ``model`` reads one of this stage's
        tables with that table's dim."""
        for module in bank_embeddings_of(model):
            if module.table not in self.tables:
                raise ValueError(f"the model's BankEmbedding reads table {module.table!r}, which the "
                                 f"BankEmbeddings stage does not look up (tables: {sorted(self.tables)})")
            if module.dim != self.dims[module.table]:
                raise ValueError(f"the model's BankEmbedding({module.table!r}) has dim {module.dim}; bank "
                                 f"table {module.table!r} has dim {self.dims[module.table]}")

    def _ids(self, batch: Batch, table: str, field: str) -> np.ndarray:
        if field not in batch:
            raise ValueError(f"BankEmbeddings reads table {table!r} ids from batch[{field!r}], which the "
                             f"batch lacks (it has {sorted(batch)})")
        ids = np.asarray(batch[field])
        if ids.dtype.kind not in "iu":
            raise TypeError(f"BankEmbeddings: batch[{field!r}] must hold int ids, got dtype {ids.dtype} "
                            f"shape {ids.shape}")
        if ids.size and ids.min() < 0:
            raise ValueError(f"BankEmbeddings: batch[{field!r}] (shape {ids.shape}) holds negative ids "
                             f"(min {ids.min()}); table {table!r} keys are ids >= 0")
        limit = self.num_ids.get(table)
        if limit is not None and ids.size and ids.max() >= limit:
            raise ValueError(f"BankEmbeddings: batch[{field!r}] (shape {ids.shape}) holds ids up to {ids.max()}, "
                             f"out of range for table {table!r} of num_ids {limit}")
        return ids.astype(np.int64)

    # -- the stage ---------------------------------------------------------------------------------
    def __call__(self, batch: Batch) -> Batch:
        if self.knowledge is not None:
            batch = self.knowledge(batch)
        if not isinstance(batch, dict):
            raise TypeError(f"each batch must be a dict of arrays, got {type(batch).__name__}")
        ids = {table: [self._ids(batch, table, field) for field in fields] for table, fields in self.tables.items()}
        self._send_again()
        self._wait_for_gradients()
        out = dict(batch)
        for table, fields in self.tables.items():
            flat = np.concatenate([i.ravel() for i in ids[table]])
            unique, inverse = np.unique(flat, return_inverse=True)
            values, _ = self.bank.lookup(table, unique, insert_missing=True)
            rows = np.empty((padded_rows(len(unique), len(flat)), self.dims[table]), np.float32)
            rows[: len(unique)] = values
            rows[len(unique):] = 0.0  # only the padding is zeroed (a [24k, 64] batch: one pass less)
            out[rows_name(table)] = rows
            out[_KEYS + table] = unique
            start = 0
            for field, field_ids in zip(fields, ids[table]):
                out[index_name(field)] = inverse[start:start + field_ids.size].reshape(field_ids.shape).astype(np.int32)
                start += field_ids.size
        with self._cond:  # counted once its lookups succeeded: a call retried after recover() counts once
            self._looked_up += 1
        return out

    def _wait_for_gradients(self) -> None:
        """Block until the gradients of steps before ``looked_up - max_staleness`` are acknowledged:
        the oldest pushes in flight are awaited here (``result()``; a call to a lost shard may only
        report its loss when awaited), outside the lock so the trainer can push meanwhile."""
        while True:
            with self._cond:
                if self._pushed >= self._looked_up - self.max_staleness or self._closed:
                    return
                if not self._in_flight:  # the step that pushes them has not finished yet
                    self._cond.wait(_WAIT_SECONDS)
                    continue
                group = self._in_flight.popleft()
            self._settle_group(group)

    def _settle_group(self, group: list) -> None:
        """Await one step's pushes and count it. A push that met a lost shard counts as done, its
        unacknowledged gradients are kept for :meth:`_send_again`, and the ShardLostError is raised
        (``Trainer.fit`` then runs ``bank.recover()`` and calls the stage again, which re-sends them
        first)."""
        lost = None
        for table, keys, gradients, push_id, future in group:
            try:
                future.result()
            except ShardLostError as error:
                unapplied = keys if error.unapplied_keys is None else error.unapplied_keys
                mask = np.isin(keys, unapplied)
                with self._cond:
                    self._resend.append((table, keys[mask], gradients[mask], push_id))
                lost = lost or error
        with self._cond:
            self._pushed += 1
            self._cond.notify_all()
        if lost is not None:
            raise lost

    def _settle(self) -> None:
        """Await every push in flight (errors as :meth:`_settle_group`)."""
        while True:
            with self._cond:
                if not self._in_flight:
                    return
                group = self._in_flight.popleft()
            self._settle_group(group)

    def _send_again(self) -> None:
        """Re-send the gradients a lost shard never acknowledged (after ``recover()``), with the
        push's id: a shard whose write-ahead log recorded the push before dying skips it, so every
        gradient counts once (``resent_gradients`` counts the rows re-sent)."""
        while self._resend:
            table, keys, gradients, push_id = self._resend[0]
            self.bank.apply_gradients(table, keys, gradients, push_id=push_id)
            self._resend.pop(0)
            self.resent_gradients += len(keys)

    # -- the trainer's side ------------------------------------------------------------------------
    def begin(self) -> None:
        """Start counting steps afresh (``Trainer.fit`` calls it before its prefetcher starts)."""
        self._settle()
        with self._cond:
            self._looked_up = self._pushed = 0
            self._closed = False

    def end(self) -> None:
        """Wake a lookup waiting for gradients (the fit is over) and wait for every push."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._settle()

    def push(self, batch: Batch, gradients: dict[str, np.ndarray]) -> None:
        """Send the row gradients of a step (``{rows_name(table): [U, dim]}``) to the bank without
        waiting; only the rows of distinct ids are sent."""
        group = []
        for table in self.tables:
            keys = batch[_KEYS + table]
            rows = np.asarray(gradients[rows_name(table)][: len(keys)])
            push_id = secrets.randbits(63)  # a re-send after a lost shard counts once (_send_again)
            try:
                future = self.bank.apply_gradients_async(table, keys, rows, push_id=push_id)
            except ShardLostError:  # not sent: re-sent by the next lookup, after recovery
                with self._cond:
                    self._resend.append((table, keys, rows, push_id))
                continue
            group.append((table, keys, rows, push_id, future))
        with self._cond:
            self._in_flight.append(group)
            self._cond.notify_all()

    def flush(self) -> None:
        """Wait for every push, then apply the bank's cached gradients of these tables."""
        self._settle()
        for table in self.tables:
            self.bank.flush(table)
