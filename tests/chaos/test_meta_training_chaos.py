"""Meta-training under SIGKILL: the learner's worker dies, the learner stays down for longer than the
old restart loop lasted (~22 s), and a tiny restart budget makes it give up. One 2-worker
LocalCluster for the module; recovery times and relaunches are recorded, never asserted."""

import os
import signal
import time

import numpy as np
import pytest
from process_helpers import wait_for_no_children, wait_until

import carlskit
from carlskit._errors import ServiceGaveUpError
from carlskit.cluster._supervised import RestartPolicy
from carlskit.lopt import EvalTaskSet, EvaluationChief, LearnableAdam, MetaTraining, QuadraticFamily, QuadraticTask
from carlskit.summaries import SummaryReader

pytestmark = pytest.mark.slow

TASK = QuadraticTask(4, 10.0, 0.1)
EVAL_SETS = [EvalTaskSet("heldout", (TASK,), num_instances=2, seed=2, num_steps=5)]
# Shapes shared by ES workers and evaluation (2 pairs/instances, 5 steps): few compilations.
OPTIONS = dict(num_workers=1, num_tasks=2, num_steps=5, std=0.01, max_gradients_per_update=8,
               checkpoint_every_seconds=0.3, eval_task_sets=EVAL_SETS)
JAX_CACHE = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
             "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    """A 2-worker LocalCluster whose workers (and their replacements after a kill) share a JAX cache."""
    import psutil

    saved = {name: os.environ.get(name) for name in JAX_CACHE}
    os.environ.update(dict(zip(JAX_CACHE, (str(tmp_path_factory.mktemp("jax-cache")), "0", "0"))))
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    client = carlskit.connect(n_workers=2, threads_per_worker=1)
    try:
        yield client
    finally:
        client.close()
        for name, value in saved.items():
            os.environ.pop(name) if value is None else os.environ.__setitem__(name, value)
        assert not wait_for_no_children(before), "the cluster left processes running"


def outer_step(training):
    return training.outer_step or 0


def kill_learner_worker(client, training):
    address = training.learner_service.worker
    os.kill(client.run(os.getpid, workers=[address])[address], signal.SIGKILL)
    return time.monotonic()


def take_checkpoints_away(training):
    """The checkpoint storage becomes unusable (as an unmounted share would): a rebuilt learner
    cannot start; nothing is deleted. Returns a function that brings it back."""
    path, aside = training.checkpoint_path, training.checkpoint_path + ".away"
    os.rename(path, aside)
    with open(path, "w") as blocker:  # a file where the directory was: makedirs fails, no fresh start
        blocker.write("unavailable")

    def restore():
        os.remove(path)
        os.rename(aside, path)

    return restore


def assert_each_checkpoint_evaluated_once(client, training, directory):
    """Every checkpoint on disk is evaluated exactly once, by the run's chief or by a chief resumed
    over the same directory after it (which picks up what was still queued at stop())."""
    chief = training.chief
    evaluated, versions = list(chief.evaluated), training.checkpoints().versions()
    assert len(evaluated) == len(set(evaluated)) and chief.failed == {} and chief.missing == []
    resumed = EvaluationChief(training.lopt.rule, training.checkpoint_path, directory / "evaluation", EVAL_SETS,
                              client=client, time_scale=1.0)  # the workers have the program compiled
    try:
        for version in versions:
            resumed.wait(version, timeout=120)
        assert resumed.jobs_run == len(set(versions) - set(evaluated)), "none evaluated twice"
        assert sorted(resumed.evaluated) == versions, "none skipped"
    finally:
        resumed.close()


def assert_summary_steps_unique(directory):
    steps = SummaryReader(directory / "summaries").scalars("learner/outer_loss")["step"].to_numpy()
    assert len(steps) and len(np.unique(steps)) == len(steps), "a learner summary step written twice"
    return int(steps.max())


def test_killed_learner_is_rebuilt_from_its_checkpoint_and_es_workers_resume_without_giving_up(
        client, tmp_path, record_property):
    training = MetaTraining(LearnableAdam(), QuadraticFamily(dims=(4,)), client, directory=tmp_path,
                            **OPTIONS).start()
    try:
        wait_until(lambda: outer_step(training) >= 3 and (training.checkpoints().latest() or 0) >= 2, seconds=180)
        restarts_before, held_before = training._tasks.restarts, training._tasks.held_endings
        killed_at = kill_learner_worker(client, training)
        wait_until(lambda: training.learner_restarts >= 1, seconds=120)
        learner_back = time.monotonic() - killed_at
        recovery = training.recoveries[0]
        wait_until(lambda: outer_step(training) > recovery["resumed_from"] + 3, seconds=120)
        training_again = time.monotonic() - killed_at
        relaunches = training._tasks.restarts - restarts_before
        services = training.status()["services"]
        assert services["es worker 0"]["state"] == "running" and training._tasks.gave_up == {}
        assert services["learner"]["state"] == "running" and training.learner_restarts == 1
        assert recovery["resumed_from"] >= 2 and recovery["outer_steps_lost"] >= 0
        assert relaunches <= 3, f"{relaunches} ES worker relaunches for one learner outage"
    finally:
        training.stop(timeout=120)
    figures = dict(learner_back_seconds=round(learner_back, 2), outer_steps_again_seconds=round(training_again, 2),
                   es_relaunches=relaunches, es_waits=training._tasks.held_endings - held_before,
                   outer_steps_lost=recovery["outer_steps_lost"], rebuild_seconds=recovery["seconds"])
    print("meta-training learner kill:", figures)
    for name, value in figures.items():
        record_property(name, value)
    last_step = assert_summary_steps_unique(tmp_path)
    assert last_step > recovery["resumed_from"] + 3
    assert_each_checkpoint_evaluated_once(client, training, tmp_path)


def test_learner_outage_longer_than_the_old_restart_loop_is_waited_out(client, tmp_path, record_property):
    policy = RestartPolicy(budget_seconds=240, initial_delay_seconds=0.25, max_delay_seconds=2.0)
    training = MetaTraining(LearnableAdam(), QuadraticFamily(dims=(4,)), client, directory=tmp_path,
                            restart_policy=policy, **OPTIONS).start()
    try:
        wait_until(lambda: outer_step(training) >= 3 and (training.checkpoints().latest() or 0) >= 2, seconds=180)
        restarts_before = training._tasks.restarts
        restore = take_checkpoints_away(training)
        killed_at = kill_learner_worker(client, training)
        wait_until(lambda: training.services()["learner"]["state"] == "restarting", seconds=60)
        time.sleep(max(0.0, 25.0 - (time.monotonic() - killed_at)))  # down for 25 s (> ~22 s)
        services = training.status()["services"]
        assert services["learner"]["state"] == "restarting" and services["learner"]["failures"] >= 1
        assert services["es worker 0"]["state"] in ("waiting", "running"), services
        relaunches_while_down = training._tasks.restarts - restarts_before
        restore()
        restored_at = time.monotonic()
        wait_until(lambda: training.learner_restarts >= 1, seconds=60)
        resumed_from = training.recoveries[0]["resumed_from"]
        wait_until(lambda: outer_step(training) > resumed_from + 3, seconds=120)
        assert training._tasks.gave_up == {} and training.learner_gave_up is None
        # the ES worker may be between two relaunches (its backoff) at any one instant: running again soon
        wait_until(lambda: training.status()["services"]["es worker 0"]["state"] == "running", seconds=60)
        training.check()
    finally:
        if os.path.isfile(training.checkpoint_path):
            restore()
        training.stop(timeout=120, evaluate_final=False)
    figures = dict(outage_seconds=round(training.recoveries[0]["seconds"], 2),
                   back_after_restore_seconds=round(time.monotonic() - restored_at, 2),
                   rebuild_attempts=training.recoveries[0]["attempts"],
                   es_relaunches_while_down=relaunches_while_down,
                   outer_steps_lost=training.recoveries[0]["outer_steps_lost"])
    print("meta-training 25 s learner outage:", figures)
    for name, value in figures.items():
        record_property(name, value)
    assert_summary_steps_unique(tmp_path)


def test_a_spent_restart_budget_makes_wait_raise_service_gave_up(client, tmp_path):
    policy = RestartPolicy(budget_seconds=1.0, initial_delay_seconds=0.1, max_delay_seconds=0.3)
    training = MetaTraining(LearnableAdam(), QuadraticFamily(dims=(4,)), client, directory=tmp_path,
                            restart_policy=policy, evaluate=False, **OPTIONS).start()
    restore = None
    try:
        training.wait(3, timeout=180)
        restore = take_checkpoints_away(training)
        kill_learner_worker(client, training)
        with pytest.raises(ServiceGaveUpError, match="gave up the learner"):
            training.wait(10**6, timeout=120)
        services = training.status()["services"]
        assert services["learner"]["state"] == "gave up" and services["es worker 0"]["state"] != "gave up"
        from carlskit.widgets import ClusterStatus

        board = ClusterStatus(client, sources=[training], show_devices=False)
        assert "gave up: learner" in board.html.value
        board.close()
    finally:
        if restore is not None:
            restore()
        training.stop(timeout=60, evaluate_final=False)
    with pytest.raises(ServiceGaveUpError):
        training.check()  # still says so after stop()
