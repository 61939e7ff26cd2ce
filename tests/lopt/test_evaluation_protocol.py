"""The evaluation protocol of issue 30: the held-out set, the new problem kinds, the floored ratio,
the grid widened at its edge and the verdict."""

import numpy as np
import optax
import pytest

from carlskit.lopt import (
    DeepLinearTask,
    LearnableAdam,
    LinearRegressionTask,
    MatrixCompletionTask,
    compare_at_horizons,
    compare_to_tuned_adam,
    evaluation_problems,
    held_out_problems,
    meta_training_family,
    optax_train_curves,
    summarize_comparison,
)


def test_the_evaluation_set_holds_the_eight_of_today_and_nothing_meta_trained_on():
    problems = evaluation_problems()
    assert len(problems) >= 12
    assert held_out_problems().items() <= problems.items()
    assert not set(problems.values()) & set(meta_training_family().tasks())


@pytest.mark.parametrize("task", [DeepLinearTask(8, 3, 16), MatrixCompletionTask(12, 10, 2, 0.5, 32)], ids=repr)
def test_new_problem_kinds_start_near_one_and_adam_trains_them(task):
    curves = optax_train_curves(optax.adam(3e-2), task, 150, 2)
    assert np.all(np.isfinite(curves)) and 0.2 < curves[:, 0].mean() < 5.0
    assert curves[:, -10:].mean() < 0.3 * curves[:, 0].mean()


@pytest.mark.parametrize("build, message", [
    (lambda: DeepLinearTask(width=0), "width"), (lambda: DeepLinearTask(depth=-1), "depth"),
    (lambda: MatrixCompletionTask(observed=0.0), "observed"), (lambda: MatrixCompletionTask(rank="3"), "rank"),
])
def test_new_problem_kinds_name_the_bad_argument(build, message):
    with pytest.raises((TypeError, ValueError), match=message):
        build()


def test_floored_ratio_ties_two_solved_runs_and_keeps_unsolved_ones():
    # Adam at its tuned rate solves this well-conditioned least squares far below 1e-3 of its start
    # (noise-free), and so does the learnable Adam at a good fixed rate: floored, they tie at 1.0.
    task = LinearRegressionTask(4, 1.0, 16, 0.0)
    solver = LearnableAdam(initial_learning_rate=0.1)
    raw, = compare_to_tuned_adam(solver, {"ls": task}, 150, 2, tune_instances=2, learning_rates=(0.03, 0.1, 0.3))
    floored, = compare_to_tuned_adam(solver, {"ls": task}, 150, 2, tune_instances=2,
                                     learning_rates=(0.03, 0.1, 0.3), floor_fraction=1e-3)
    assert raw["learned"] < 1e-3 * raw["initial_loss"] and raw["tuned_adam"] < 1e-3 * raw["initial_loss"]
    assert floored["ratio"] == 1.0 and raw["ratio"] != 1.0
    # A no-op in place of the learned optimizer does not solve it: its ratio stays far above 1.
    frozen = LearnableAdam(initial_learning_rate=1e-9)
    stuck, = compare_to_tuned_adam(frozen, {"ls": task}, 150, 2, tune_instances=2, learning_rates=(0.03, 0.1, 0.3),
                                   floor_fraction=1e-3)
    assert stuck["ratio"] > 100


def test_a_grid_whose_best_rate_is_at_an_edge_is_widened_until_inside():
    task = LinearRegressionTask(4, 1.0, 16, 0.1)
    lopt = LearnableAdam(initial_learning_rate=0.01)
    narrow, = compare_to_tuned_adam(lopt, {"ls": task}, 60, 2, tune_instances=2, learning_rates=(1e-4, 3e-4))
    assert narrow["adam_learning_rate"] == 3e-4 and not narrow["rate_inside_grid"]
    wide, = compare_to_tuned_adam(lopt, {"ls": task}, 60, 2, tune_instances=2, learning_rates=(1e-4, 3e-4), widen=6)
    assert wide["adam_learning_rate"] > 3e-4 and wide["rate_inside_grid"]


def test_horizons_and_the_verdict():
    task = DeepLinearTask(6, 2, 16)
    lopt = LearnableAdam(initial_learning_rate=0.01, train_horizon=20)
    rows = compare_at_horizons(lopt, {"deep": task}, 20, (1, 3), num_instances=2)
    assert [r["horizon"] for r in rows] == [20, 60] and [r["multiple"] for r in rows] == [1, 3]
    verdict = summarize_comparison(rows)
    assert verdict["cases"] == 2 and verdict["worst_case"].startswith("deep @")
    hand = [{"problem": "a", "ratio": 0.5}, {"problem": "b", "ratio": 2.0}, {"problem": "c", "ratio": 1.0},
            {"problem": "d", "ratio": 0.25}]
    verdict = summarize_comparison(hand)
    assert verdict["at_or_below_adam"] == 0.75 and verdict["worse_than_allowed"] == 1
    assert verdict["worst_case"] == "b" and verdict["worst_ratio"] == 2.0
    np.testing.assert_allclose(verdict["geomean"], (0.5 * 2.0 * 1.0 * 0.25) ** 0.25)
    with pytest.raises(ValueError, match="rows"):
        summarize_comparison([])
    with pytest.raises(ValueError, match="multiples"):
        compare_at_horizons(lopt, {"deep": task}, 20, ())
