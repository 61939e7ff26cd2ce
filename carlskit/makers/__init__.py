"""Knowledge makers (CARLS section 3.1): asynchronous workers that refresh the bank's knowledge.

A maker's slices are long-running tasks supervised by :class:`carlskit.cluster.LongRunningTasks`
(the service kit); each loads the newest intact checkpoint (:mod:`carlskit.checkpoints`) and reads
its tables' typed configs from the bank (``KnowledgeBank.table_config``). Makers import neither
``training`` nor another subpackage's private modules.
"""

from carlskit.makers._builtin import AgreementMaker, EmbeddingMaker, LabelMaker, NeighborMaker, predict_labels
from carlskit.makers._maker import Maker, MakerContext, run_maker_slice

__all__ = ["Maker", "MakerContext", "AgreementMaker", "EmbeddingMaker", "LabelMaker", "NeighborMaker", "predict_labels",
           "run_maker_slice"]
