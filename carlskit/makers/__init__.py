"""Knowledge makers (CARLS section 3.1): asynchronous workers that refresh the bank's knowledge."""

from carlskit.makers._builtin import AgreementMaker, EmbeddingMaker, LabelMaker, NeighborMaker, predict_labels
from carlskit.makers._maker import Maker, MakerContext, run_maker_slice

__all__ = ["Maker", "MakerContext", "AgreementMaker", "EmbeddingMaker", "LabelMaker", "NeighborMaker", "predict_labels",
           "run_maker_slice"]
