"""The CARLS trainer (paper section 3.3): checkpoints, input pipeline with bank knowledge, losses."""

from carlskit.training._checkpoint import CheckpointStore, restore_model
from carlskit.training._knowledge import NeighborKnowledge, check_embedding_dim
from carlskit.training._losses import graph_regularization, masked_cross_entropy, pairwise_distance
from carlskit.training._pipeline import Prefetcher
from carlskit.training._trainer import FitHandle, Trainer

__all__ = ["CheckpointStore", "restore_model", "NeighborKnowledge", "check_embedding_dim",
           "graph_regularization", "masked_cross_entropy", "pairwise_distance", "Prefetcher",
           "FitHandle", "Trainer"]
