"""GShard Mixture-of-Experts: gating functions, MoE layers, ``MoEModel`` and sharding annotations.

Lepikhin et al. 2020, "GShard: Scaling Giant Models with Conditional Computation and Automatic
Sharding".

``MoEModel.fit`` trains with the same jitted step as :class:`carlskit.training.Trainer`
(``carlskit/_step.py``), without importing the trainer. Arguments are checked by
``carlskit/_checks.py``: ``TypeError`` for a wrong type, ``ValueError`` for a bad value, naming it.
"""

from carlskit.moe._data import (
    BYTE_VOCAB_SIZE,
    PAD_ID,
    stdlib_text_corpus,
    stdlib_text_documents,
    toy_multilingual_corpus,
)
from carlskit.moe._dispatch import combine, combine_einsum, combine_scatter, dispatch, dispatch_einsum, dispatch_gather
from carlskit.moe._gating import (
    Routing,
    expert_capacity,
    expert_choice_gating,
    load_balancing_loss,
    route,
    router_z_loss,
    top1_gating,
    top2_gating,
)
from carlskit.moe._layers import CausalSelfAttention, FeedForward, MoEFeedForward, TransformerBlock
from carlskit.moe._model import MoEModel
from carlskit.moe._sharding import auto_axes, make_mesh, replicate, shard, split
from carlskit.moe._text_lm import TEXT_LM_SIZES, text_lm_comparison
from carlskit.moe._translation import TranslationModel, length_penalty, translation_scores
from carlskit.moe._translation_analyses import ExpertAssignment, capacity_overflow, expert_assignment
from carlskit.moe._translation_comparison import TRANSLATION_SIZES, translation_comparison

__all__ = [
    "BYTE_VOCAB_SIZE",
    "PAD_ID",
    "TEXT_LM_SIZES",
    "TRANSLATION_SIZES",
    "CausalSelfAttention",
    "ExpertAssignment",
    "FeedForward",
    "MoEFeedForward",
    "MoEModel",
    "Routing",
    "TransformerBlock",
    "TranslationModel",
    "auto_axes",
    "capacity_overflow",
    "combine",
    "combine_einsum",
    "combine_scatter",
    "dispatch",
    "dispatch_einsum",
    "dispatch_gather",
    "expert_assignment",
    "expert_capacity",
    "expert_choice_gating",
    "length_penalty",
    "load_balancing_loss",
    "make_mesh",
    "replicate",
    "route",
    "router_z_loss",
    "shard",
    "split",
    "stdlib_text_corpus",
    "stdlib_text_documents",
    "text_lm_comparison",
    "top1_gating",
    "top2_gating",
    "toy_multilingual_corpus",
    "translation_comparison",
    "translation_scores",
]
