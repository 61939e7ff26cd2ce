"""The knowledge bank (CARLS section 3.2): sharded embeddings and feature records shared by trainers
and makers, with lazy averaged gradient updates and nearest-neighbour search."""

from ._bank import KnowledgeBank, ShardLostError
from ._hashing import key_from_string
from ._lazy import CombinedGradients, adagrad_step, combine_gradients, sgd_step

__all__ = ["KnowledgeBank", "ShardLostError", "key_from_string", "combine_gradients",
           "CombinedGradients", "sgd_step", "adagrad_step"]
