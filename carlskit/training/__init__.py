"""The CARLS trainer (paper section 3.3): input pipeline with bank knowledge, losses; checkpoints
(``CheckpointStore``, ``restore_model``) are re-exported from :mod:`carlskit.checkpoints`, below
training, makers and lopt.

The trainer's jitted step (``carlskit/_step.py``: the loss's gradient with respect to the model's
``nnx.Param`` variables, applied by an ``nnx.Optimizer``) is the one that
:meth:`carlskit.moe.MoEModel.fit` takes too. Widgets (the live plot) are imported only when a fit displays them.
"""

from carlskit.checkpoints import CheckpointStore, restore_model
from carlskit.training._embeddings import BankEmbedding, BankEmbeddings
from carlskit.training._knowledge import BankNegatives, MinedLabels, NeighborKnowledge, check_embedding_dim
from carlskit.training._losses import (
    graph_regularization,
    info_nce,
    masked_cross_entropy,
    pairwise_distance,
    select_mined_labels,
)
from carlskit.training._pipeline import Prefetcher
from carlskit.training._trainer import FitHandle, Trainer

__all__ = ["CheckpointStore", "restore_model", "BankEmbedding", "BankEmbeddings",
           "BankNegatives", "MinedLabels", "NeighborKnowledge",
           "check_embedding_dim", "graph_regularization", "info_nce", "masked_cross_entropy", "pairwise_distance",
           "select_mined_labels", "Prefetcher", "FitHandle", "Trainer"]
