"""Evaluation curves and the evaluation chief (in-process)."""

import dataclasses
import json
import pathlib
import time

import jax
import numpy as np
import optax
import pytest

from carlskit._errors import CorruptFileError, ServiceGaveUpError, WorkerLostError
from carlskit._serialization import dumps_checked_json
from carlskit.cluster._supervised import RestartPolicy
from carlskit.lopt import (
    EvalTaskSet,
    EvaluationChief,
    LearnableAdamRule,
    MLPUpdateRule,
    QuadraticTask,
    Task,
    evaluation_curves,
    train_tasks_vectorized,
)
from carlskit.training import CheckpointStore

RULE = LearnableAdamRule()
TASK = QuadraticTask(4, 10.0, 0.1)
# One task structure and one shape everywhere: every evaluation shares one compiled program.
TASK_SETS = [EvalTaskSet("heldout", (TASK,), num_instances=2, seed=2, num_steps=5),
             EvalTaskSet("train_subset", (TASK,), num_instances=2, seed=1, num_steps=5)]


def publish(store, version, scale, rule=RULE):
    meta_params = jax.tree.map(lambda x: x * scale, rule.init_meta_params(jax.random.PRNGKey(0)))
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


def test_chief_records_unloadable_checkpoints_as_failed_and_evaluates_the_others(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt", keep=None)
    publish(store, 0, 1.0)
    publish(store, 1, 1.0)
    npz = tmp_path / "ckpt" / f"v{1:012d}.npz"
    npz.write_bytes(npz.read_bytes()[:100])  # truncated
    publish(store, 2, 1.0, rule=MLPUpdateRule())  # written by a learner of another rule
    chief = EvaluationChief(RULE, store.path, tmp_path / "eval", TASK_SETS[:1])
    for _ in range(3):
        chief.poll()  # never raises: each bad checkpoint is recorded once, the good one goes on
    chief.wait(0, timeout=120)
    assert sorted(chief.failed) == [1, 2] and "cannot load checkpoint" in chief.failed[1]
    with pytest.raises(RuntimeError, match="checkpoint 2 failed"):
        chief.wait(2, timeout=5)
    assert chief.status()["failed"] == chief.failed and chief.evaluated == [0]
    chief.close()
    restarted = EvaluationChief(RULE, store.path, tmp_path / "eval", TASK_SETS[:1])
    assert restarted.failed == chief.failed, "failures are durable: a restarted chief does not retry them"
    assert restarted.poll() == [] and restarted.status()["in_flight"] == []
    restarted.close()


@dataclasses.dataclass(frozen=True)
class UnfinishedTask(Task):
    """A user task without ``init``: every evaluation job raises NotImplementedError."""


def test_chief_gives_up_a_checkpoint_whose_jobs_keep_failing(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt", keep=None)
    publish(store, 0, 1.0)
    broken = [EvalTaskSet("broken", (UnfinishedTask(),), num_instances=1, num_steps=2)]
    chief = EvaluationChief(RULE, store.path, tmp_path / "eval", broken)
    with pytest.raises(RuntimeError, match="failed 3 times.*NotImplementedError"):
        chief.wait(0, timeout=30, poll_seconds=0.01)
    chief.poll()
    assert chief.status()["queued_jobs"] == 0 and chief.status()["in_flight"] == [], "no retry after giving up"
    chief.close()


def test_chief_and_task_sets_validate_numbers_and_names(tmp_path):
    for time_scale, error in (("x", TypeError), (0.0, ValueError), (float("nan"), ValueError), (True, TypeError)):
        with pytest.raises(error, match="time_scale"):
            EvaluationChief(RULE, str(tmp_path), tmp_path / "eval", TASK_SETS, time_scale=time_scale)
    with pytest.raises(TypeError, match="num_steps"):
        EvalTaskSet("heldout", (TASK,), num_steps=2.5)
    with pytest.raises(ValueError, match="num_instances"):
        EvalTaskSet("heldout", (TASK,), num_instances=0)
    with pytest.raises(TypeError, match="name"):
        EvalTaskSet(None, (TASK,))
    with pytest.raises(TypeError, match="tasks"):
        EvalTaskSet("heldout", TASK)
    assert EvalTaskSet("heldout", [TASK], num_steps=np.int64(3)).num_steps == 3


def test_corrupt_chief_state_is_a_corrupt_file_error_naming_the_file(tmp_path):
    (tmp_path / "eval").mkdir()
    state = tmp_path / "eval" / "chief_state.json"
    good = dumps_checked_json({"evaluated": [1, 2], "missing": [], "failed": {}})
    flipped = good.replace(b"1,", b"4,", 1)  # one changed value under an unchanged checksum
    for data in (b'{"evaluated": [1, 2', b"[1, 2]", b'{"evaluated": [1, 2]}', flipped,
                 dumps_checked_json({"evaluated": ["x"]}), dumps_checked_json({"failed": {"a": "b"}})):
        state.write_bytes(data)
        with pytest.raises(CorruptFileError, match="chief_state.json: corrupt") as raised:
            EvaluationChief(RULE, str(tmp_path / "ckpt"), tmp_path / "eval", TASK_SETS)
        assert raised.value.path == str(state)


def test_damaged_result_file_is_set_aside_and_its_checkpoint_evaluated_again_once(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt", keep=None)
    publish(store, 0, 1.0)
    publish(store, 1, 2.0)
    chief = EvaluationChief(RULE, store.path, tmp_path / "eval", TASK_SETS[:1])
    chief.wait(1, timeout=120)
    chief.wait(0, timeout=120)
    chief.close()
    result = chief.result_path(1)
    result.write_bytes(result.read_bytes().replace(b"[", b"[1e3, ", 1))  # a changed curve value
    restarted = EvaluationChief(RULE, store.path, tmp_path / "eval", TASK_SETS[:1])
    assert restarted.evaluated == [0] and "SHA-256" in restarted.corrupt_results[1]
    restarted.wait(1, timeout=120)
    assert restarted.jobs_run == 1 and sorted(restarted.results()) == [0, 1] and restarted.corrupt_results == {}
    assert json.loads(result.read_bytes())["content"]["version"] == 1
    restarted.close()


@dataclasses.dataclass(frozen=True)
class LostWorkerTask(QuadraticTask):
    """Its first ``losses`` evaluations end as if their worker died (``WorkerLostError``): the chief's
    thread pool stands in for the workers that a cluster test kills."""

    counter: str = ""
    losses: int = 2

    def init(self, key, task_params):
        path = pathlib.Path(self.counter)
        count = int(path.read_text()) if path.exists() else 0
        if count < self.losses:
            path.write_text(str(count + 1))
            raise WorkerLostError(f"evaluation worker lost ({count + 1})")
        return super().init(key, task_params)


def test_jobs_lost_with_their_worker_cost_no_attempt_and_are_retried_with_backoff(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt", keep=None)
    publish(store, 0, 1.0)
    task = LostWorkerTask(4, 10.0, 0.1, counter=str(tmp_path / "count"), losses=MAX_LOSSES)
    policy = RestartPolicy(budget_seconds=60, initial_delay_seconds=0.01, max_delay_seconds=0.05)
    chief = EvaluationChief(RULE, store.path, tmp_path / "eval", [EvalTaskSet("lossy", (task,), 1, num_steps=2)],
                            restart_policy=policy)
    chief.wait(0, timeout=60, poll_seconds=0.01)  # more losses than MAX_ATTEMPTS, yet evaluated
    assert chief.worker_losses == MAX_LOSSES and chief.failed == {} and chief.evaluated == [0]
    assert chief.supervision()["state"] == "running" and chief.supervision()["failures"] == 0
    chief.close()


MAX_LOSSES = 4


def test_chief_gives_up_when_workers_keep_being_lost_past_its_budget(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt", keep=None)
    publish(store, 0, 1.0)
    task = LostWorkerTask(4, 10.0, 0.1, counter=str(tmp_path / "count"), losses=10**6)
    policy = RestartPolicy(budget_seconds=0.3, initial_delay_seconds=0.01, max_delay_seconds=0.02)
    chief = EvaluationChief(RULE, store.path, tmp_path / "eval", [EvalTaskSet("lossy", (task,), 1, num_steps=2)],
                            restart_policy=policy)
    deadline = time.monotonic() + 60
    while chief.gave_up is None and time.monotonic() < deadline:
        chief.poll()
    with pytest.raises(ServiceGaveUpError, match="kept being lost"):
        chief.check()
    assert chief.supervision()["state"] == "gave up" and chief.failed == {}, "the checkpoint itself is not blamed"
    assert chief.poll() == [] and chief.status()["gave_up"]
    chief.close()
