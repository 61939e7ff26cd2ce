"""carlskit: knowledge computed beside training, giant sparse models, trained optimizers.

Public names are re-exported here; implementations live in one subpackage per system part. The
re-exports are resolved on first use (PEP 562), so ``import carlskit`` and the worker plugin that
``connect()`` ships to Dask workers do not import JAX: workers must be configured before JAX starts.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "connect": "carlskit.cluster",
    "devices": "carlskit.cluster",
    "KnowledgeBank": "carlskit.bank",
    "CheckpointStore": "carlskit.checkpoints",
    "Trainer": "carlskit.training",
    "BankNegatives": "carlskit.training",
    "BankEmbedding": "carlskit.training",
    "BankEmbeddings": "carlskit.training",
    "Maker": "carlskit.makers",
    "EmbeddingMaker": "carlskit.makers",
    "NeighborMaker": "carlskit.makers",
    "LabelMaker": "carlskit.makers",
    "AgreementMaker": "carlskit.makers",
    "MoEModel": "carlskit.moe",
    "TranslationModel": "carlskit.moe",
    "LearnedOptimizer": "carlskit.lopt",
    "MetaTraining": "carlskit.lopt",
    "SummaryWriter": "carlskit.summaries",
    "SummaryReader": "carlskit.summaries",
    "RestartPolicy": "carlskit.cluster",
    "History": "carlskit._history",  # what every training loop returns (imports only NumPy)
    # exception types: from a module that imports neither JAX nor Dask
    "CorruptFileError": "carlskit._errors",
    "ServiceGaveUpError": "carlskit._errors",
    "WorkerLostError": "carlskit._errors",
    "RankFailedError": "carlskit._errors",
    "RankLostError": "carlskit._errors",
}
_SUBPACKAGES = ("bank", "checkpoints", "cluster", "data", "lopt", "makers", "moe", "paradigms", "summaries",
                "training", "widgets")

__all__ = [*_EXPORTS, *_SUBPACKAGES]

if TYPE_CHECKING:  # static analysers and IDEs see the eager imports
    from carlskit import widgets
    from carlskit._errors import CorruptFileError, RankFailedError, RankLostError, ServiceGaveUpError, WorkerLostError
    from carlskit._history import History
    from carlskit.bank import KnowledgeBank
    from carlskit.checkpoints import CheckpointStore
    from carlskit.cluster import RestartPolicy, connect, devices
    from carlskit.lopt import LearnedOptimizer, MetaTraining
    from carlskit.makers import AgreementMaker, EmbeddingMaker, LabelMaker, Maker, NeighborMaker
    from carlskit.moe import MoEModel, TranslationModel
    from carlskit.summaries import SummaryReader, SummaryWriter
    from carlskit.training import BankEmbedding, BankEmbeddings, BankNegatives, Trainer


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"carlskit.{name}")
    else:
        raise AttributeError(f"module 'carlskit' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
