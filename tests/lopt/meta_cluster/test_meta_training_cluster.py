"""MetaTraining end to end: embedded (threads) and on a Dask cluster whose processes we kill."""

import dataclasses
import os
import signal

import numpy as np
import optax
import pytest
from process_helpers import wait_until

import carlskit
from carlskit.lopt import EvalTaskSet, LearnableAdam, MetaTraining, QuadraticFamily, QuadraticTask, Task
from carlskit.lopt._gradient_store import call

TASK = QuadraticTask(4, 10.0, 0.1)
# Shapes shared by ES workers and evaluation (2 pairs/instances, 5 steps): few compilations.
OPTIONS = dict(num_tasks=2, num_steps=5, std=0.01, max_gradients_per_update=8,
               eval_task_sets=[EvalTaskSet("heldout", (TASK,), num_instances=2, seed=2, num_steps=5)])


def outer_step(training):
    return training.learner_status().get("outer_step") or 0


def bad_records(training):
    step, leaves = call(training.learner, "current")
    nan = [np.full(np.shape(x), np.nan, np.float32) for x in leaves]
    wrong = [np.zeros((2, 3), np.float32) for _ in leaves]
    return [{"id": f"bad-{kind}", "grad": grad, "outer_step": step, "task_family": "injected",
             "losses": np.zeros((1, 2)), "outer_loss": 0.0, "worker": -1, "seconds": 0.0}
            for kind, grad in (("nan", nan), ("shape", wrong))]


def test_embedded_meta_training_learns_checkpoints_evaluates_and_resumes(tmp_path):
    family = QuadraticFamily(dims=(4,), noise_std=0.1)
    # Adam at 0.15 on the meta-parameters: LearnableAdam's log learning rate climbs fast enough for a
    # clear gain within ~50 outer steps (measured: held-out final loss 1.22 -> 0.06 by step 52).
    training = MetaTraining(LearnableAdam(), family, None, directory=tmp_path, num_workers=2,
                            checkpoint_every_seconds=0.2, outer_optimizer=optax.adam(0.15), **OPTIONS).start()
    try:
        wait_until(lambda: outer_step(training) >= 5 and len(training.eval_results) >= 2, seconds=120)
        call(training.gradient_store, "put_many", bad_records(training))
        wait_until(lambda: sum(training.learner_status()["rejected"].values()) == 2, seconds=30)
        status = training.status()
        assert {k: v for k, v in status["rejected"].items() if v} == {"shape": 1, "non_finite": 1}
        assert status["received"] >= 5 and status["worker_errors"] == 0 and status["es_workers_running"] == 2
        assert status["families"][0]["task_family"] == repr(family.tasks()[0])
        wait_until(lambda: max(training.eval_results, default=0) >= 40, seconds=120)
    finally:
        training.stop()
    # It learned: the evaluation chief's held-out curves of the best checkpoint against the initial
    # optimizer's (checkpoint 0): mean validation loss over the 5 steps at most 0.8x.
    def heldout_loss(version):
        return float(np.mean(training.eval_results[version]["heldout"]["valid"]))

    best_loss = min(heldout_loss(version) for version in training.eval_results)
    assert best_loss <= 0.8 * heldout_loss(0), {v: heldout_loss(v) for v in sorted(training.eval_results)}
    stopped_at = training.learner_status()["outer_step"]
    assert training.checkpoints().latest() == stopped_at, "stop() checkpoints the last meta-parameters"
    best = training.best_checkpoint("heldout", "valid")
    curves = training.learned_optimizer(best).train_curves(TASK, 5, num_tasks=2)
    assert curves.shape == (2, 5) and np.isfinite(curves).all()

    evaluated = sorted(training.eval_results)
    again = MetaTraining(LearnableAdam(), family, None, directory=tmp_path, num_workers=1,
                         checkpoint_every_seconds=0.2, **OPTIONS).start()
    try:
        wait_until(lambda: outer_step(again) > stopped_at, seconds=60)
        assert again.learner_status()["resumed_from"] == stopped_at
    finally:
        again.stop()
    done = again.chief.evaluated
    assert set(evaluated) <= set(done) and len(done) == len(set(done)) and stopped_at in evaluated
    assert again.chief.jobs_run == len(set(done) - set(evaluated)), "one job per new checkpoint, none repeated"


@dataclasses.dataclass(frozen=True)
class UnfinishedTask(Task):
    """A user task without ``init``: its evaluation jobs always raise."""


def test_stop_closes_the_chief_even_when_the_final_evaluation_fails(tmp_path):
    options = {**OPTIONS, "eval_task_sets": [EvalTaskSet("broken", (UnfinishedTask(),), num_instances=1, num_steps=5)]}
    training = MetaTraining(LearnableAdam(), TASK, None, directory=tmp_path, num_workers=1, **options).start()
    chief = training.chief
    training.stop(timeout=30)  # the final checkpoint's evaluation fails: stop() still finishes
    assert not training.learner_service.driving
    # the final checkpoint's evaluation failed (0, or 1 when the learner wrote another before stop came)
    assert chief.failed and all("NotImplementedError" in why for why in chief.failed.values()), chief.failed
    with pytest.raises(RuntimeError, match="shutdown"):
        chief._pool.submit(print)  # closed: its thread pool takes no more jobs
    with pytest.raises(ValueError, match="max_staleness"):
        MetaTraining(LearnableAdam(), TASK, None, directory=tmp_path, max_staleness=-1)


def processing_worker(client, prefix):
    return next(worker for worker, keys in client.processing().items() if any(k.startswith(prefix) for k in keys))


@pytest.mark.slow
def test_cluster_survives_killing_an_es_worker_and_the_learner(tmp_path, no_leftover_processes, monkeypatch):
    # Worker processes (and their replacements after a kill) share compiled programs on disk.
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax-cache"))
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    client = carlskit.connect(n_workers=2, threads_per_worker=1)
    try:
        training = MetaTraining(LearnableAdam(), QuadraticFamily(dims=(4,)), client, directory=tmp_path,
                                num_workers=1, checkpoint_every_seconds=0.3, **OPTIONS).start()
        wait_until(lambda: outer_step(training) >= 3, seconds=120)

        call(training.gradient_store, "put_many", bad_records(training))  # a faulty worker's gradients
        wait_until(lambda: {k: v for k, v in training.learner_status()["rejected"].items() if v}
                   == {"shape": 1, "non_finite": 1})

        es_worker = processing_worker(client, "es-worker")
        assert es_worker != training.learner_service.worker, "ES workers avoid the learner's worker"
        os.kill(client.run(os.getpid, workers=[es_worker])[es_worker], signal.SIGKILL)
        before = outer_step(training)
        wait_until(lambda: outer_step(training) >= before + 3, seconds=120)
        assert training.learner_restarts == 0 and training.learner_status()["resumed_from"] is None, \
            "the learner kept its state while the ES worker was replaced"

        latest = training.checkpoints().latest()
        service = training.learner_service.worker
        os.kill(client.run(os.getpid, workers=[service])[service], signal.SIGKILL)
        wait_until(lambda: training.learner_restarts >= 1 and outer_step(training) > latest + 2, seconds=120)
        resumed_from = training.learner_status()["resumed_from"]
        assert resumed_from is not None and resumed_from >= latest, "resumed from its latest checkpoint"
        wait_until(lambda: training.status()["es_workers_running"] == 1, seconds=60)
        wait_until(lambda: len(training.eval_results) >= 1, seconds=120)
        training.stop()
        assert training.status()["evaluation"]["evaluated"] >= 1
    finally:
        client.close()


def test_embedded_meta_training_with_truncated_pes_on_the_workers_learns(tmp_path):
    family = QuadraticFamily(dims=(4,), noise_std=0.1)
    heldout = [EvalTaskSet("heldout", (TASK,), num_instances=2, seed=2, num_steps=20)]
    training = MetaTraining(LearnableAdam(), family, None, directory=tmp_path, num_workers=2, num_tasks=2,
                            num_steps=20, estimator="pes", truncation_length=5, min_num_steps=5, std=0.01,
                            checkpoint_every_seconds=0.2, outer_optimizer=optax.adam(0.15), eval_task_sets=heldout,
                            summaries=False).start()
    try:
        wait_until(lambda: max(training.eval_results, default=0) >= 40, seconds=180)
        status = training.status()
        assert status["worker_errors"] == 0 and status["families"][0]["count"] >= 40
    finally:
        training.stop()
    loss = {v: float(np.mean(training.eval_results[v]["heldout"]["valid"])) for v in training.eval_results}
    assert min(loss.values()) <= 0.8 * loss[0], loss
    with pytest.raises(ValueError, match="truncation_length"):
        MetaTraining(LearnableAdam(), family, None, directory=tmp_path, estimator="pes", num_steps=20)
