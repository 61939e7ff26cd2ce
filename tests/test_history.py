"""``carlskit.History``: the one history format every training loop returns (a list of per-step records)."""

import json

import numpy as np
import pytest

from carlskit import History


def records():
    return History([{"step": 1, "loss": 3.0, "load": np.ones(2)},
                    {"step": 2, "loss": 2.0, "load": np.zeros(2), "eval_loss": 2.5},
                    {"step": 3, "loss": 1.0, "load": np.ones(2)}])


def test_a_history_is_a_list_of_records_with_columns_and_series():
    history = records()
    assert isinstance(history, list) and len(history) == 3 and history[-1]["step"] == 3
    np.testing.assert_array_equal(history.column("loss"), [3.0, 2.0, 1.0])
    assert history.column("load").shape == (3, 2)  # array-valued records stack
    steps, values = history.series("eval_loss")  # only the records that have it
    assert steps.tolist() == [2] and values.tolist() == [2.5]
    assert isinstance(history[1:], History) and history[1:].column("loss").tolist() == [2.0, 1.0]
    assert json.loads(json.dumps([{"step": r["step"], "loss": r["loss"]} for r in history]))[0]["loss"] == 3.0
    assert "3 records" in repr(history) and repr(History()) == "History([])"


def test_reading_a_history_as_the_old_dict_of_lists_says_what_replaced_it():
    history = records()
    with pytest.raises(TypeError, match=r"history.column\('loss'\)"):
        history["loss"]
    with pytest.raises(KeyError, match="no record has 'accuracy'"):
        history.column("accuracy")
    assert History().column("loss").shape == (0,)
