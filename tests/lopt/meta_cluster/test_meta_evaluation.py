"""Evaluation curves and the evaluation chief (in-process)."""

import jax
import numpy as np
import optax
import pytest

from carlskit.lopt import (EvalTaskSet, EvaluationChief, LearnableAdamRule, QuadraticTask, evaluation_curves,
                           train_tasks_vectorized)
from carlskit.training import CheckpointStore

RULE = LearnableAdamRule()
TASK = QuadraticTask(4, 10.0, 0.1)
# One task structure and one shape everywhere: every evaluation shares one compiled program.
TASK_SETS = [EvalTaskSet("heldout", (TASK,), num_instances=2, seed=2, num_steps=5),
             EvalTaskSet("train_subset", (TASK,), num_instances=2, seed=1, num_steps=5)]


def publish(store, version, scale):
    meta_params = jax.tree.map(lambda x: x * scale, RULE.init_meta_params())
    store.save({"meta_params": meta_params, "outer_state": optax.adam(1e-3).init(meta_params)}, version=version)


def test_train_curve_is_inner_training_and_heldout_curves_use_other_minibatches():
    theta = RULE.init_meta_params()
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    curves = evaluation_curves(RULE, TASK, theta, keys, 5)
    np.testing.assert_allclose(curves["train"], train_tasks_vectorized(RULE, TASK, theta, keys, 5), rtol=1e-5)
    assert curves["valid"].shape == curves["test"].shape == (2, 5)
    assert not np.allclose(curves["valid"], curves["train"]) and not np.allclose(curves["valid"], curves["test"])


def test_restarted_chief_neither_repeats_nor_skips_checkpoints(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt", keep=None)
    publish(store, 0, 1.0)
    publish(store, 1, 2.0)
    seen = []
    chief = EvaluationChief(RULE, store.path, tmp_path / "eval", TASK_SETS, eval_workers=2,
                            on_result=lambda version, curves: seen.append(version))
    chief.wait(1, timeout=120)
    chief.wait(0, timeout=120)
    assert seen == [1, 0] and chief.jobs_run == 4, "newest checkpoint first, each once"
    publish(store, 2, 0.5)
    chief.poll()  # enqueued (maybe started), then the chief "crashes" before finishing version 2
    chief.close()

    restarted = EvaluationChief(RULE, store.path, tmp_path / "eval", TASK_SETS, eval_workers=2,
                                on_result=lambda version, curves: seen.append(version))
    publish(store, 3, 0.25)
    restarted.wait(3, timeout=120)
    restarted.wait(2, timeout=120)
    assert sorted(seen) == [0, 1, 2, 3] and len(seen) == 4, "each checkpoint evaluated exactly once"
    assert restarted.jobs_run == 4, "only the two new checkpoints' jobs ran after the restart"
    results = restarted.results()
    assert sorted(results) == [0, 1, 2, 3]
    assert set(results[2]) == {"heldout", "train_subset"} and set(results[2]["heldout"]) == {"train", "valid", "test"}
    assert len(results[3]["heldout"]["test"]) == 5
    assert restarted.best_checkpoint("heldout", "valid") in results
    restarted.close()


def test_chief_validates_task_sets(tmp_path):
    with pytest.raises(TypeError, match="task_sets"):
        EvaluationChief(RULE, str(tmp_path), tmp_path / "eval", [])
    with pytest.raises(ValueError, match="distinct"):
        EvaluationChief(RULE, str(tmp_path), tmp_path / "eval", [TASK_SETS[0], TASK_SETS[0]])
