"""Knowledge stages: ids that are not int item ids, and tables of the wrong kind, are named errors."""

import numpy as np
import pytest

from carlskit.bank import KnowledgeBank
from carlskit.makers import LabelMaker
from carlskit.training import BankNegatives, MinedLabels, NeighborKnowledge, check_embedding_dim


@pytest.fixture
def bank():
    bank = KnowledgeBank()
    bank.create_table("emb", dim=2, initializer="zeros")
    bank.create_feature_table("nbrs", schema={"ids": ("int64", 3), "weights": ("float32", 3)})
    bank.create_feature_table("labels", schema=LabelMaker.SCHEMA)
    bank.update("emb", [1, 2], np.array([[1.0, 1.0], [2.0, 2.0]], np.float32), version=0)
    bank.update("nbrs", [1], {"ids": [[2, -1, -1]], "weights": [[1.0, 0, 0]]}, version=0)
    bank.update("labels", [1], {"label": [[7]], "confidence": [[0.9]]}, version=0)
    return bank


def stages(bank):
    return [NeighborKnowledge(bank, max_neighbors=2), MinedLabels(bank),
            BankNegatives(bank, {"emb": "x"}, num_negatives=1, candidates=np.arange(10))]


def test_float_or_2d_or_missing_ids_are_errors_not_truncated_lookups(bank):
    for stage in stages(bank):
        name = type(stage).__name__
        with pytest.raises(TypeError, match=rf"{name}: batch\['ids'\] must hold int item ids, got dtype float"):
            stage({"ids": np.array([1.7, 2.2])})  # used to look up items 1 and 2
        with pytest.raises(ValueError, match=rf"{name}: batch\['ids'\] must be 1-D .* shape \(2, 1\)"):
            stage({"ids": np.array([[1], [2]])})
        with pytest.raises(ValueError, match=r"batch\['ids'\], which the batch lacks \(it has \['x'\]\)"):
            stage({"x": np.zeros(2)})
    assert stages(bank)[1]({"ids": np.array([1], np.int32)})["mined_labels"].tolist() == [7]


def test_tables_of_the_wrong_kind_or_fields_are_named(bank):
    with pytest.raises(ValueError, match="table 'emb' must be a feature table"):
        NeighborKnowledge(bank, max_neighbors=2, records_table="emb")
    with pytest.raises(ValueError, match="table 'labels' must be a feature table with fields"):
        NeighborKnowledge(bank, max_neighbors=2, records_table="labels")
    with pytest.raises(ValueError, match="table 'nbrs' must be an embedding table"):
        NeighborKnowledge(bank, max_neighbors=2, embeddings_table="nbrs")
    with pytest.raises(TypeError, match="max_neighbors must be a positive int, got 1.5"):
        NeighborKnowledge(bank, max_neighbors=1.5)
    with pytest.raises(ValueError, match="table 'emb' must be a feature table"):
        MinedLabels(bank, table="emb")
    with pytest.raises(ValueError, match="table 'nbrs' must be an embedding table"):
        check_embedding_dim(bank, "nbrs", 2)
    with pytest.raises(TypeError, match="num_negatives"):  # a bool is not an int: TypeError since issue 16
        BankNegatives(bank, {"emb": "x"}, num_negatives=True, candidates=np.arange(10))
