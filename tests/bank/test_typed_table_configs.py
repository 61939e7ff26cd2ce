"""Typed table configs: exported, accepted by create_table, returned by table_config and checked there."""

import numpy as np
import pytest

from carlskit.bank import EmbeddingTableConfig, FeatureTableConfig, KnowledgeBank


def test_create_table_takes_a_config_object_and_table_config_returns_it_typed():
    kb = KnowledgeBank(num_shards=2)
    config = EmbeddingTableConfig(dim=4, optimizer="adagrad", learning_rate=0.5)
    kb.create_table("emb", config)
    kb.create_table("also", 4, optimizer="adagrad", learning_rate=0.5)
    kb.create_table("records", FeatureTableConfig({"ids": ("int64", 3), "weights": ("float32", 3)}))
    assert kb.table_config("emb") == config == kb.table_config("also"), "the same table either way"
    assert kb.tables["emb"] == kb.tables["also"] == config.to_dict()
    assert kb.table_config("records", "feature", ("ids", "weights")).fields["ids"] == ("int64", 3)
    assert kb.table_config("emb", "embedding").dim == 4
    kb.update("emb", [1, 2], np.ones((2, 4), np.float32), version=1)
    assert kb.lookup("emb", [1])[0].shape == (1, 4)


@pytest.mark.parametrize("call, error, match", [
    (lambda kb: kb.table_config("missing"), ValueError, "no table 'missing'"),
    (lambda kb: kb.table_config("emb", "feature"), ValueError, "must be a feature table, got an embedding table"),
    (lambda kb: kb.table_config("records", "feature", ("label",)), ValueError, r"fields \['ids', 'weights'\]"),
    (lambda kb: kb.create_table("x", EmbeddingTableConfig(dim=2), seed=1), TypeError, "no other options"),
    (lambda kb: kb.create_table("emb", EmbeddingTableConfig(dim=2)), ValueError, "already exists"),
])
def test_table_config_and_create_table_reject_what_does_not_fit(call, error, match):
    kb = KnowledgeBank()
    kb.create_table("emb", 4)
    kb.create_feature_table("records", {"ids": ("int64", 3), "weights": ("float32", 3)})
    before = kb.tables
    with pytest.raises(error, match=match):
        call(kb)
    assert kb.tables == before, "nothing created or changed"
