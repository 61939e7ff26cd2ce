"""Makers: bad arguments are named at construction; items outside the features are named errors."""

import numpy as np
import pytest

from carlskit.bank import KnowledgeBank
from carlskit.cluster import RestartPolicy
from carlskit.makers import AgreementMaker, EmbeddingMaker, LabelMaker, Maker, NeighborMaker
from carlskit.makers._maker import MakerContext


def never_called(*args):
    raise AssertionError("the model must not be built for bad items")


def write_nothing(context):
    return None


def context(items, bank=None):
    return MakerContext(np.asarray(items, np.int64), 1, {}, {}, bank, 0)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"num_slices": 2.5}, TypeError, "num_slices must be a positive int, got 2.5"),
    ({"num_slices": 0}, ValueError, "num_slices must be a positive int, got 0"),
    ({"poll_seconds": 0}, ValueError, "poll_seconds must be a finite number > 0"),
    ({"poll_seconds": float("nan")}, ValueError, "poll_seconds"),
    ({"restart_policy": -1}, ValueError, "restart_policy must be a finite number > 0, got -1"),
    ({"restart_policy": float("inf")}, ValueError, "restart_policy must be finite"),
    ({"restart_policy": "60"}, TypeError, "restart_policy must be a RestartPolicy or a budget in seconds, got str"),
    ({"restart_policy": 5}, None, None),
])
def test_maker_arguments_are_checked_at_construction(kwargs, error, message):
    if message is None:  # accepted: a budget in seconds becomes the default policy with that budget
        assert Maker(write_nothing, np.arange(4), **kwargs).restart_policy == RestartPolicy(budget_seconds=5.0)
        return
    with pytest.raises(error, match=message):  # TypeError for a wrong type, ValueError for a bad value
        Maker(write_nothing, np.arange(4), **kwargs)


def test_a_restart_policy_is_taken_as_given_and_none_is_the_default():
    policy = RestartPolicy(budget_seconds=30.0, max_delay_seconds=2.0)
    assert Maker(write_nothing, np.arange(4), restart_policy=policy).restart_policy is policy
    assert Maker(write_nothing, np.arange(4)).restart_policy == RestartPolicy()


def test_builtin_maker_arguments_are_named():
    features = np.zeros((5, 3), np.float32)
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        EmbeddingMaker(never_called, never_called, features, batch_size=0)
    with pytest.raises(ValueError, match=r"features must be non-empty arrays .* rows \{'a': 5, 'b': 4\}"):
        EmbeddingMaker(never_called, never_called, {"a": features, "b": features[:4]})
    with pytest.raises(ValueError, match="non-empty dict"):
        EmbeddingMaker(never_called, never_called, {})
    with pytest.raises(ValueError, match=r"rows \{'features': 0\}"):
        LabelMaker(never_called, np.zeros((0, 3)))
    with pytest.raises(ValueError, match=r"neighbor_ids must be rows of features in \[0, 5\).*\[-1, 7\]"):
        AgreementMaker(never_called, features, np.array([[1, -1], [7, 0], [0, 0], [0, 0], [0, 0]]))
    with pytest.raises(TypeError, match="k must be a positive int, got 2.0"):
        NeighborMaker(2.0)


@pytest.mark.parametrize("items", [[-1], [5]])
def test_items_outside_the_features_are_errors_not_another_rows_values(items):
    features = np.arange(10, dtype=np.float32).reshape(5, 2)
    with pytest.raises(ValueError, match=r"EmbeddingMaker: items must be row indices of features in \[0, 5\)"):
        EmbeddingMaker(never_called, never_called, features)(context(items))  # [-1] read row 4's features
    agreement = AgreementMaker(never_called, features, np.full((5, 2), -1))
    with pytest.raises(ValueError, match=r"AgreementMaker: items must be row indices"):
        agreement(context(items))


def test_neighbor_maker_k_wider_than_the_records_is_named_before_any_lookup():
    bank = KnowledgeBank()
    bank.create_table("emb", dim=2)
    bank.create_feature_table("nbrs", schema={"ids": ("int64", 2), "weights": ("float32", 2)})
    with pytest.raises(ValueError, match="k=3 exceeds the 'nbrs' record width 2"):
        NeighborMaker(3)(context([0, 1], bank))
    with pytest.raises(ValueError, match="table 'emb' must be a feature table"):
        NeighborMaker(1, records_table="emb")(context([0, 1], bank))
