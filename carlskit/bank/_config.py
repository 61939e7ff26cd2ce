"""Table configurations: frozen, typed dataclasses, each option defined (with its check) once.

``KnowledgeBank.create_table(name, dim, ...)`` builds an :class:`EmbeddingTableConfig` from its
keywords, ``create_feature_table`` a :class:`FeatureTableConfig`; the shards and their tables read
the options as attributes, and a snapshot manifest stores :meth:`TableConfig.to_json` (a flat JSON
object ``{"kind": ..., option: value, ...}``, infinite floats as the strings ``"inf"``/``"-inf"``),
read back by :meth:`TableConfig.from_json` with the same checks as ``create_table``.

An embedding-table option is one line of :class:`EmbeddingTableConfig`: its name, type, default and
check (``_option(check, default, **limits)``). Checks run in field order when a config is built;
a bad value raises TypeError/ValueError naming the option, an unknown option TypeError naming it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, ClassVar

import numpy as np

from carlskit._checks import choice, finite_float, int64, integer, positive_float
from carlskit.bank._lazy import COMBINES
from carlskit.bank._nearest import METRICS

INITIALIZERS = ("zeros", "normal", "uniform")
OPTIMIZERS = ("sgd", "adagrad")
INDEXES = ("flat", "hnsw")
#: the widest row a table may have (``dim``, a feature field's width)
MAX_WIDTH = 1 << 16


def _option(check: Callable[..., Any], default: Any = dataclasses.MISSING, **limits: Any) -> Any:
    """A config field checked by ``check(value, name, **limits)`` when the config is built."""
    return dataclasses.field(default=default, metadata={"check": functools.partial(check, **limits)})


def _optional(check: Callable[..., Any]) -> Callable[..., Any]:
    """``check``, letting None through (an option whose default is computed from the others)."""
    return lambda value, name, **limits: None if value is None else check(value, name, **limits)


def _json_value(value: Any) -> Any:
    """Strict JSON has no Infinity: infinite floats (e.g. a ttl that never expires) as strings."""
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


class TableConfig:
    """Base of the table configs: checks on construction, ``to_dict``/``to_json``/``from_json``."""

    kind: ClassVar[str]

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            check = field.metadata.get("check")
            if check is not None:
                object.__setattr__(self, field.name, check(getattr(self, field.name), field.name))

    def to_dict(self) -> dict[str, Any]:
        """``{"kind": ..., option: value}`` as ``KnowledgeBank.tables`` shows it (a new dict)."""
        return {"kind": self.kind, **{field.name: getattr(self, field.name)
                                      for field in dataclasses.fields(self)}}

    def to_json(self) -> dict[str, Any]:
        """:meth:`to_dict` as strict JSON (the snapshot manifest's form)."""
        return {key: _json_value(value) for key, value in self.to_dict().items()}

    @classmethod
    def from_json(cls, data: Any) -> "TableConfig":
        """The config :meth:`to_json` wrote (``TableConfig.from_json`` picks the kind), checked like
        ``create_table``'s arguments: TypeError/ValueError naming a bad or unknown option."""
        if not isinstance(data, dict):
            raise TypeError(f"a table config must be a dict, got {type(data).__name__}")
        kinds = {kind.kind: kind for kind in (EmbeddingTableConfig, FeatureTableConfig)}
        kind = kinds.get(data.get("kind"))
        if kind is None or not issubclass(kind, cls):
            allowed = [name for name, k in kinds.items() if issubclass(k, cls)]
            raise ValueError(f"kind must be one of {allowed}, got {data.get('kind')!r}")
        options = {key: float(value) if value in ("inf", "-inf") else value
                   for key, value in data.items() if key != "kind"}
        return kind(**options)


@dataclasses.dataclass(frozen=True)
class EmbeddingTableConfig(TableConfig):
    """An embedding table: float32 rows of ``dim``, their initial values and the lazy update rule
    (see ``KnowledgeBank.create_table`` and :mod:`carlskit.bank._lazy`)."""

    kind: ClassVar[str] = "embedding"
    dim: int = _option(integer, minimum=1, maximum=MAX_WIDTH)
    initializer: str = _option(choice, "normal", allowed=INITIALIZERS)
    seed: int = _option(int64, 0)
    _: dataclasses.KW_ONLY
    init_scale: float | None = _option(_optional(finite_float), None, minimum=0.0)  # None: 1/sqrt(dim)
    optimizer: str = _option(choice, "sgd", allowed=OPTIMIZERS)
    learning_rate: float = _option(positive_float, 0.1)
    initial_accumulator_value: float = _option(finite_float, 0.1, minimum=0.0)
    epsilon: float = _option(positive_float, 1e-7)
    max_pending: int = _option(integer, 16, minimum=1)
    pending_ttl_seconds: float = _option(finite_float, 60.0, minimum=0.0, allow_infinity=True)
    outlier_threshold: float = _option(positive_float, 3.0)
    combine: str = _option(choice, "mean", allowed=COMBINES)
    index: str = _option(choice, "flat", allowed=INDEXES)
    index_metric: str = _option(choice, "dot", allowed=METRICS)
    hnsw_m: int = _option(integer, 32, minimum=2)
    hnsw_ef_search: int = _option(integer, 64, minimum=1)
    min_count: int = _option(integer, 1, minimum=1)
    max_idle_seconds: float = _option(finite_float, math.inf, positive=True, allow_infinity=True)
    max_rows_per_shard: int | None = _option(_optional(integer), None, minimum=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.init_scale is None:
            object.__setattr__(self, "init_scale", 1.0 / math.sqrt(self.dim))
        if self.evicts and self.index == "hnsw":
            raise ValueError("max_idle_seconds / max_rows_per_shard (eviction) need index='flat': an HNSW graph "
                             "cannot remove rows")

    @property
    def evicts(self) -> bool:
        """Whether rows are evicted (idle time or a capacity)."""
        return math.isfinite(self.max_idle_seconds) or self.max_rows_per_shard is not None


def _schema(schema: Any, name: str) -> tuple[tuple[str, str, int], ...]:
    """A feature table's schema ``{field: (dtype, width)}`` as ((field, dtype name, width), ...)."""
    if not isinstance(schema, dict) or not schema:
        raise ValueError(f"{name} must be a non-empty dict {{field: (dtype, width)}}")
    clean = []
    for field, spec in schema.items():
        if not isinstance(field, str) or not field:
            raise ValueError(f"{name} field names must be non-empty str, got {field!r}")
        if not isinstance(spec, (tuple, list)) or len(spec) != 2:
            raise ValueError(f"{name}[{field!r}] must be (dtype, width), got {spec!r}")
        try:
            if spec[0] is None:  # np.dtype(None) is float64
                raise TypeError("no dtype")
            dtype = np.dtype(spec[0])
        except TypeError as error:
            raise ValueError(f"{name}[{field!r}] has an unknown dtype {spec[0]!r}") from error
        if dtype.kind not in "iufb":
            raise ValueError(f"{name}[{field!r}] dtype must be numeric or bool, got {dtype}")
        clean.append((field, dtype.name, integer(spec[1], f"{name}[{field!r}] width", minimum=1,
                                                 maximum=MAX_WIDTH)))
    return tuple(clean)


@dataclasses.dataclass(frozen=True)
class FeatureTableConfig(TableConfig):
    """A feature table: fixed-width records, ``schema`` = {field: (dtype, width)}, kept as a tuple
    of (field, dtype name, width) in the order given (``to_dict`` shows it as {field: [dtype, width]})."""

    kind: ClassVar[str] = "feature"
    schema: Any = _option(_schema)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "schema": {field: [dtype, width]
                                              for field, dtype, width in self.schema}}

    @property
    def fields(self) -> dict[str, tuple[str, int]]:
        """``{field: (dtype name, width)}`` in schema order (a new dict)."""
        return {field: (dtype, width) for field, dtype, width in self.schema}

    def __post_init__(self) -> None:
        if isinstance(self.schema, tuple):  # already checked (a copy: dataclasses.replace)
            object.__setattr__(self, "schema", {f: (d, w) for f, d, w in self.schema})
        super().__post_init__()
