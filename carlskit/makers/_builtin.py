"""Built-in knowledge makers: embeddings and mined labels from the latest model, a learned neighbour graph."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from flax import nnx

from carlskit._checks import finite_float, instance, positive_int
from carlskit.makers._maker import MakerContext


def _item_features(features: Any) -> tuple[np.ndarray | dict[str, np.ndarray], int]:
    """``features`` (one array [n, ...] or a non-empty dict of them, all of n rows) and n."""
    if isinstance(features, dict):
        if not features:
            raise ValueError("features must be an array [n, ...] or a non-empty dict of them, got {}")
        arrays = {name: np.asarray(values) for name, values in features.items()}
    else:
        arrays = {"features": np.asarray(features)}
    rows = {name: values.shape[0] if values.ndim else None for name, values in arrays.items()}
    if None in rows.values() or 0 in rows.values() or len(set(rows.values())) != 1:
        raise ValueError(f"features must be non-empty arrays [n, ...] of one n, got rows {rows}")
    return (arrays if isinstance(features, dict) else arrays["features"]), next(iter(rows.values()))


def _check_items(items: np.ndarray, num_rows: int, maker: str) -> None:
    """Items index feature rows: one outside [0, num_rows) would fail or, if negative, silently read another row."""
    if len(items) and (items.min() < 0 or items.max() >= num_rows):
        raise ValueError(f"{maker}: items must be row indices of features in [0, {num_rows}), got items in "
                         f"[{items.min()}, {items.max()}]")


class EmbeddingMaker:
    """Run the model's encoder on the maker's items and write the results to the bank.

    ``model_factory()`` builds the model (same structure as the trainer's; picklable, e.g. a module
    level function or ``functools.partial``); ``encode(model, features) -> {table: [n, dim]}``
    (or one array, written to ``table``). ``features`` is one array [n, ...] or, for several
    inputs per item (e.g. two modalities), a dict of them, each [n, ...]; ``encode`` then receives
    the dict of each batch's rows. Items are encoded in batches of ``batch_size``; each batch is
    one chunk of the maker's CPU budget (``Maker(..., max_cpu_fraction=f)`` sleeps after it).
    """

    def __init__(self, model_factory: Callable[[], nnx.Module], encode: Callable,
                 features: np.ndarray | dict[str, np.ndarray], *, table: str = "emb", batch_size: int = 1024):
        if not callable(model_factory) or not callable(encode):
            raise TypeError(f"model_factory and encode must be callable, got {type(model_factory).__name__} "
                            f"and {type(encode).__name__}")
        instance(table, "table", str, "a table name (str)")
        self.model_factory = model_factory
        self.encode = encode
        self.features, self.num_rows = _item_features(features)
        self.table = table
        self.batch_size = positive_int(batch_size, "batch_size")
        self._model = None
        self._encode = None
        self._lock = threading.Lock()

    def __getstate__(self):
        return {**self.__dict__, "_model": None, "_encode": None, "_lock": None}

    def __setstate__(self, state):
        self.__dict__.update(state, _lock=threading.Lock())

    def __call__(self, context: MakerContext) -> None:
        with self._lock:  # slices running as threads share this object and its model copy
            self._encode_items(context)

    def _encode_items(self, context: MakerContext) -> None:
        for table, values in self._encode_all(context).items():
            context.bank.update(table, context.items, values.astype(np.float32), version=context.version)

    def _encode_all(self, context: MakerContext) -> dict[str, np.ndarray]:
        """Restore the checkpoint into this maker's model copy and encode every item, in batches;
        returns ``{name: [n, ...]}`` (one array from ``encode`` is named ``self.table``)."""
        _check_items(context.items, self.num_rows, type(self).__name__)
        if self._model is None:
            self._model = self.model_factory()
            graphdef = nnx.graphdef(self._model)
            encode = self.encode

            import jax

            @jax.jit
            def encode_state(state, features):
                return encode(nnx.merge(graphdef, state), features)

            self._encode = encode_state
        context.restore_model(self._model)
        state = nnx.state(self._model)
        outputs: dict[str, list[np.ndarray]] = {}
        for start in range(0, len(context.items), self.batch_size):
            items = context.items[start:start + self.batch_size]
            rows = ({name: values[items] for name, values in self.features.items()}
                    if isinstance(self.features, dict) else self.features[items])
            encoded = self._encode(state, rows)
            if not isinstance(encoded, dict):
                encoded = {self.table: encoded}
            for name, values in encoded.items():
                outputs.setdefault(name, []).append(np.asarray(values))
            context.pace()  # a batch is one chunk of the maker's CPU budget (Maker's max_cpu_fraction)
        return {name: np.concatenate(parts) for name, parts in outputs.items()}


def predict_labels(model: nnx.Module, features: Any) -> dict[str, Any]:
    """Dropout-free class distribution p = softmax(model(x, deterministic=True)); returns the mined
    ``label`` = argmax_c p_c and its ``confidence`` = max_c p_c (CARLS section 4.2.1)."""
    import jax
    import jax.numpy as jnp

    probabilities = jax.nn.softmax(model(features, deterministic=True), axis=-1)
    return {"label": jnp.argmax(probabilities, axis=-1), "confidence": jnp.max(probabilities, axis=-1)}


class LabelMaker(EmbeddingMaker):
    """Mine a label and its confidence for every item from the latest checkpoint (CARLS 4.2.1).

    ``model_factory()`` builds a classifier called as ``model(features, deterministic=True) ->
    logits [n, classes]``. Each round writes ``{"label": int64 [1], "confidence": float32 [1]}``
    records (``label = argmax softmax``, ``confidence = max softmax``, in [0, 1]) to the feature
    table ``table`` with the checkpoint's version; create it with ``LabelMaker.SCHEMA``.
    """

    SCHEMA = {"label": ("int64", 1), "confidence": ("float32", 1)}

    def __init__(self, model_factory: Callable[[], nnx.Module], features: np.ndarray, *,
                 table: str = "labels", batch_size: int = 1024):
        super().__init__(model_factory, predict_labels, features, table=table, batch_size=batch_size)

    def _encode_items(self, context: MakerContext) -> None:
        mined = self._encode_all(context)
        records = {"label": mined["label"].astype(np.int64)[:, None],
                   "confidence": np.clip(mined["confidence"].astype(np.float32), 0.0, 1.0)[:, None]}
        context.bank.update(self.table, context.items, records, version=context.version)


class AgreementMaker(EmbeddingMaker):
    """Score every edge of a graph with the latest agreement model (GAM, CARLS section 4.2.2).

    ``model_factory()`` builds an agreement model with ``embed(features) -> [n, H]`` (a
    dropout-free encoder) and ``agreement(h_left, h_right) -> [...]`` (the probability that two
    items share a label, in [0, 1]). ``neighbor_ids`` [num_items, W] int64 (padded with -1) is the
    graph. Each round encodes the slice's items and their neighbours once, then writes records
    ``{"ids": [W] int64, "weights": [W] float32}`` with ``weights_ik = agreement(i, ids_ik)`` (0 for
    padding) to the feature table ``table`` (create it with ``AgreementMaker.schema(W)``), so a
    :class:`~carlskit.training.NeighborKnowledge` stage serves agreement-weighted neighbours.
    """

    def __init__(self, model_factory: Callable[[], nnx.Module], features: np.ndarray, neighbor_ids: np.ndarray,
                 *, table: str = "nbrs", batch_size: int = 1024):
        super().__init__(model_factory, _embed, features, table=table, batch_size=batch_size)
        neighbor_ids = np.asarray(neighbor_ids)
        if neighbor_ids.ndim != 2 or neighbor_ids.shape[0] != self.num_rows or \
                not np.issubdtype(neighbor_ids.dtype, np.integer):
            raise ValueError(f"neighbor_ids must be an int array [{self.num_rows}, W], got "
                             f"{neighbor_ids.dtype} {neighbor_ids.shape}")
        if neighbor_ids.size and (neighbor_ids.min() < -1 or neighbor_ids.max() >= self.num_rows):
            raise ValueError(f"neighbor_ids must be rows of features in [0, {self.num_rows}) or -1 (padding), "
                             f"got values in [{neighbor_ids.min()}, {neighbor_ids.max()}]")
        self.neighbor_ids = neighbor_ids.astype(np.int64)

    @staticmethod
    def schema(width: int) -> dict[str, tuple[str, int]]:
        return {"ids": ("int64", width), "weights": ("float32", width)}

    def _encode_items(self, context: MakerContext) -> None:
        _check_items(context.items, self.num_rows, type(self).__name__)
        ids = self.neighbor_ids[context.items]
        real = ids >= 0
        needed = np.unique(np.concatenate([context.items, ids[real]]))
        hidden = next(iter(self._encode_all(dataclasses.replace(context, items=needed)).values()))
        left = hidden[np.searchsorted(needed, context.items)][:, None, :]
        right = hidden[np.searchsorted(needed, np.where(real, ids, needed[0]))]
        scores = np.asarray(self._model.agreement(left, right), np.float32)
        weights = np.where(real, np.clip(scores, 0.0, 1.0), 0.0).astype(np.float32)
        context.bank.update(self.table, context.items, {"ids": ids, "weights": weights}, version=context.version)


def _embed(model: nnx.Module, features: Any) -> Any:
    return model.embed(features)


class NeighborMaker:
    """Rebuild each item's k nearest neighbours from the bank's embeddings (a learned graph).

    Reads the items' embeddings from ``table``, asks ``bank.nearest`` for ``k`` neighbours by
    ``metric`` excluding the item itself, and writes ``{"ids", "weights"}`` records to
    ``records_table``. Weights are 1 for every neighbour found (-1 padding gets 0). Until the
    embeddings exist, the round is retried rather than counted.

    With a given graph (``given_ids`` [num_items, W] int64 padded with -1, ``given_weights`` [num_items,
    W], rows indexed by item id) each record is the given neighbours, weights times ``1 - mix``,
    followed by the ``k`` nearest, weights ``mix`` (the paper's dynamic graph mixed with the given
    one); the records table must be at least ``W + k`` wide.
    """

    def __init__(self, k: int, *, table: str = "emb", records_table: str = "nbrs", metric: str = "cosine",
                 given_ids: np.ndarray | None = None, given_weights: np.ndarray | None = None, mix: float = 1.0):
        k = positive_int(k, "k")
        instance(table, "table", str, "a table name (str)")
        instance(records_table, "records_table", str, "a table name (str)")
        self.k, self.table, self.records_table, self.metric = k, table, records_table, metric
        if (given_ids is None) != (given_weights is None):
            raise ValueError("given_ids and given_weights come together (both or neither)")
        if given_ids is not None:
            given_ids, given_weights = np.asarray(given_ids), np.asarray(given_weights, np.float32)
            if given_ids.ndim != 2 or given_weights.shape != given_ids.shape or given_ids.dtype.kind not in "iu":
                raise ValueError(f"given_ids must be an int array [num_items, W] and given_weights of its shape, "
                                 f"got {given_ids.dtype} {given_ids.shape} and {given_weights.shape}")
            given_ids = given_ids.astype(np.int64)
        mix = finite_float(mix, "mix")
        if not 0.0 <= mix <= 1.0:
            raise ValueError(f"mix must be in [0, 1], got {mix}")
        self.given_ids, self.given_weights, self.mix = given_ids, given_weights, mix

    def __call__(self, context: MakerContext) -> bool:
        bank: Any = context.bank
        width = bank.table_config(self.records_table, "feature", ("ids", "weights")).fields["ids"][1]
        if self.k > width:  # checked before reading anything, not a broadcasting error after nearest()
            raise ValueError(f"NeighborMaker k={self.k} exceeds the {self.records_table!r} record width {width}")
        embeddings, found = bank.lookup(self.table, context.items)
        items = context.items[found]
        if len(items) == 0:
            return False  # no embeddings yet (the embedding maker has not written them): retry
        neighbors, _ = bank.nearest(self.table, embeddings[found], k=self.k, metric=self.metric, exclude=items)
        given = 0 if self.given_ids is None else self.given_ids.shape[1]
        if given + self.k > width:
            raise ValueError(f"NeighborMaker: {given} given + k={self.k} neighbours exceed the "
                             f"{self.records_table!r} record width {width}")
        ids = np.full((len(items), width), -1, np.int64)
        weights = np.zeros((len(items), width), np.float32)
        if given:
            _check_items(items, len(self.given_ids), type(self).__name__)
            ids[:, :given] = self.given_ids[items]
            weights[:, :given] = np.where(ids[:, :given] >= 0, self.given_weights[items] * (1.0 - self.mix), 0.0)
        ids[:, given:given + self.k] = neighbors
        weights[:, given:given + self.k] = np.where(neighbors >= 0, self.mix if given else 1.0, 0.0)
        bank.update(self.records_table, items, {"ids": ids, "weights": weights}, version=context.version)
        return True
