"""carlskit: knowledge computed beside training, giant sparse models, trained optimizers.

Public names are re-exported here; implementations live in one subpackage per system part.
"""

from carlskit import widgets
from carlskit.bank import KnowledgeBank
from carlskit.cluster import connect, devices
from carlskit.lopt import LearnedOptimizer
from carlskit.makers import EmbeddingMaker, Maker, NeighborMaker
from carlskit.moe import MoEModel
from carlskit.summaries import SummaryReader, SummaryWriter
from carlskit.training import CheckpointStore, Trainer

__version__ = "0.1.0"

__all__ = [
    "connect", "devices", "KnowledgeBank", "CheckpointStore", "Trainer", "Maker", "EmbeddingMaker",
    "NeighborMaker", "MoEModel", "LearnedOptimizer", "SummaryWriter", "SummaryReader", "widgets",
]
