"""Continuous evaluation of meta-training checkpoints (Metz et al. 2020, Appendix H.1).

* :func:`evaluation_curves` (pure, jitted): inner training of task instances with any update rule,
  recording per inner step the *train* loss (the minibatch the step trains on), and the loss of the
  same parameters on a *validation* and a *test* minibatch drawn from separate key streams
  (``fold_in(task_key, 3)`` and ``fold_in(task_key, 4)``; the training stream is ``fold_in(task_key, 1)``).
* :class:`EvalTaskSet`: a fixed set of task structures and instance seeds.
* :class:`EvaluationChief`: watches the checkpoint directory; for each new checkpoint it enqueues
  one job per (task set, task structure) on the evaluation workers (Dask tasks, or threads here),
  aggregates the curves per checkpoint (mean over instances and structures), writes them to
  ``<eval_dir>/v<version>.json`` and to summaries, and records the version in
  ``<eval_dir>/chief_state.json``, all atomically, so a restarted chief neither repeats nor skips.
  A checkpoint that cannot be loaded (corrupt: :class:`carlskit.CorruptFileError`), or whose jobs
  fail ``MAX_ATTEMPTS`` times, is recorded as failed (with the reason) and skipped; the newer and
  older intact ones go on.

Evaluation workers are supervised (the service kit of :mod:`carlskit.cluster`): a job lost with its
worker (decided by type, :func:`carlskit.cluster.is_worker_loss`) is not the checkpoint's fault, so
it costs no attempt; the checkpoint's jobs run again after the backoff delay of the chief's
:class:`carlskit.cluster.ServiceState` under its :class:`RestartPolicy`, and only when worker losses
go on for longer than its time budget does the chief give up (``supervision()["state"] == "gave
up"``, :meth:`EvaluationChief.check` raises :class:`carlskit.ServiceGaveUpError`).

Durable files are checksummed JSON (:func:`carlskit._serialization.dumps_checked_json`): a damaged
state file raises :class:`carlskit.CorruptFileError` naming it; a damaged result file is set aside
(``corrupt_results``) and its checkpoint evaluated again, so no result is lost or trusted unchecked.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import pathlib
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from carlskit._checks import integer, positive_float, positive_int
from carlskit._errors import CorruptFileError
from carlskit._serialization import atomic_write, dumps_checked_json, filesystem, loads_checked_json, unflatten_into
from carlskit.checkpoints import CheckpointStore
from carlskit.cluster import Placement, RestartPolicy, ServiceState, ServiceStatus, is_worker_loss, live_workers
from carlskit.cluster import restart_policy as restart_policy_of
from carlskit.lopt._inner import init_inner_state, inner_step
from carlskit.lopt._outer import meta_params_structure
from carlskit.lopt._protocols import Task, TaskFamily, UpdateRule

logger = logging.getLogger("carlskit.lopt.evaluation")

PyTree = Any
SPLITS = ("train", "valid", "test")
STATE_FILE = "chief_state.json"
MAX_ATTEMPTS = 3  # evaluations of one checkpoint (its jobs all run again after a failure) before it is failed


@functools.partial(jax.jit, static_argnames=("rule", "task", "num_steps"))
def evaluation_curves(rule: UpdateRule, task: Task, meta_params: PyTree, task_keys: jax.Array, num_steps: int,
                      time_scale: float = 1.0) -> dict[str, jax.Array]:
    """Train/validation/test losses ``[num_tasks, num_steps]`` of training each instance from scratch.

    Step ``t``: ``train_t = L(p_t, batch_t)``, ``valid_t = L(p_t, valid_batch_t)``,
    ``test_t = L(p_t, test_batch_t)``; ``p_{t+1} = p_t + update(grad L(p_t, batch_t))``.
    ``rule`` is a learned update rule or any optax optimizer wrapped as one, so baselines are
    evaluated on exactly the same instances and minibatches.
    """

    def one_task(task_key):
        task_params = task.sample_task_params(jax.random.fold_in(task_key, 2))
        streams = [jax.random.fold_in(task_key, stream) for stream in (1, 3, 4)]

        def body(state, _):
            batches = [task.batch(jax.random.fold_in(stream, state.step), task_params) for stream in streams]
            held_out = [task.loss(state.params, batch, task_params) for batch in batches[1:]]
            state, loss = inner_step(rule, task, meta_params, state, batches[0], task_params, time_scale,
                                     num_steps)
            return state, jnp.stack([loss, *held_out])

        state = init_inner_state(rule, task, task_key, task_params)
        _, losses = jax.lax.scan(body, state, None, length=num_steps)
        return losses  # [num_steps, 3]

    losses = jax.vmap(one_task)(task_keys)
    return {split: losses[:, :, index] for index, split in enumerate(SPLITS)}


@dataclasses.dataclass(frozen=True)
class EvalTaskSet:
    """Fixed evaluation tasks: ``num_instances`` instances (keys from ``seed``) of each structure."""

    name: str
    tasks: tuple[Task, ...]
    num_instances: int = 4
    seed: int = 0
    num_steps: int = 50

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"name must be a non-empty str, got {self.name!r}")
        if not isinstance(self.tasks, (list, tuple)) or not self.tasks \
                or not all(isinstance(task, Task) for task in self.tasks):
            raise TypeError(f"tasks of {self.name!r} must be a non-empty tuple of Task, got {self.tasks!r}")
        object.__setattr__(self, "tasks", tuple(self.tasks))
        object.__setattr__(self, "num_instances", positive_int(self.num_instances, "num_instances"))
        object.__setattr__(self, "num_steps", positive_int(self.num_steps, "num_steps"))
        object.__setattr__(self, "seed", integer(self.seed, "seed", 0))


def default_eval_task_sets(family: TaskFamily, *, ood_tasks: tuple[Task, ...] = (), num_steps: int = 50,
                           num_instances: int = 4, max_structures: int = 3) -> list[EvalTaskSet]:
    """The three sets of the paper's chief: ``train_subset`` (training structures, the instance seed
    ES workers never draw from: a fixed sample of the training distribution), ``heldout`` (the same
    structures, other instances) and ``ood`` (``ood_tasks``, when given)."""
    structures = tuple(family.tasks())[:max_structures]
    sets = [EvalTaskSet("train_subset", structures, num_instances, seed=1, num_steps=num_steps),
            EvalTaskSet("heldout", structures, num_instances, seed=2, num_steps=num_steps)]
    if ood_tasks:
        sets.append(EvalTaskSet("ood", tuple(ood_tasks), num_instances, seed=3, num_steps=num_steps))
    return sets


def evaluate_job(rule: UpdateRule, meta_leaves: list[np.ndarray], task: Task, seed: int, num_instances: int,
                 num_steps: int, time_scale: float) -> dict[str, list[float]]:
    """One evaluation job (runs on an evaluation worker): mean curves over instances, per split."""
    treedef, _ = meta_params_structure(rule)
    meta_params = jax.tree.unflatten(treedef, [jnp.asarray(leaf) for leaf in meta_leaves])
    keys = jax.random.split(jax.random.PRNGKey(seed), num_instances)
    curves = evaluation_curves(rule, task, meta_params, keys, num_steps, time_scale)
    return {split: np.asarray(jnp.mean(values, axis=0), np.float64).tolist() for split, values in curves.items()}


def load_meta_params_checkpoint(store: CheckpointStore, rule: UpdateRule, version: int | None = None
                                ) -> tuple[PyTree, dict]:
    """The ``meta_params`` subtree of a learner checkpoint, in ``rule``'s structure, and its metadata."""
    arrays, metadata = store.load(version)
    head = "['meta_params']"
    subset = {name[len(head):]: value for name, value in arrays.items() if name.startswith(head)}
    template = jax.eval_shape(rule.init_meta_params, jax.random.PRNGKey(0))
    return unflatten_into(template, subset, {}), metadata


class EvaluationChief:
    """Evaluate every checkpoint in ``checkpoint_path`` once, over ``task_sets``.

    Args:
      rule: the learned optimizer's update rule.
      checkpoint_path: the learner's checkpoint directory.
      eval_dir: where results and the chief's state are written.
      task_sets: the fixed :class:`EvalTaskSet` s.
      client: Dask client (jobs are Dask tasks on the workers) or ``None`` (a thread pool here).
      eval_workers: jobs in flight at most.
      time_scale: the learned optimizer's time-feature scale for these runs (training horizon /
        evaluation length), a finite number > 0.
      logdir: summaries directory (``None``: none).
      on_result: called with ``(version, {task_set: {split: curve}})`` when a checkpoint is done.
      restart_policy: how long jobs lost with their workers are retried (a :class:`RestartPolicy`
        or a budget in seconds; default 10 minutes).
      placement: the workers jobs may run on (:class:`carlskit.cluster.Placement`), resolved to the
        live ones at every submission; a job whose allowed workers are all gone is cancelled and
        retried (a lost job). Default: off accelerator workers when there are others.
    """

    def __init__(self, rule: UpdateRule, checkpoint_path: str, eval_dir: str | os.PathLike,
                 task_sets: list[EvalTaskSet], *, client: Any = None, eval_workers: int = 1,
                 time_scale: float = 1.0, logdir: str | None = None,
                 on_result: Callable[[int, dict], None] | None = None, placement: Placement | None = None,
                 restart_policy: RestartPolicy | float | None = None) -> None:
        if not task_sets or not all(isinstance(s, EvalTaskSet) for s in task_sets):
            raise TypeError("task_sets must be a non-empty list of EvalTaskSet")
        if len({s.name for s in task_sets}) != len(task_sets):
            raise ValueError("task_sets must have distinct names")
        eval_workers = positive_int(eval_workers, "eval_workers")
        time_scale = positive_float(time_scale, "time_scale")
        policy = restart_policy_of(restart_policy, "restart_policy")
        self.rule, self.task_sets, self.client = rule, list(task_sets), client
        self.eval_workers, self.time_scale, self.on_result = eval_workers, time_scale, on_result
        self.placement = placement if placement is not None else Placement()
        self._allowed: dict[Any, set[str]] = {}  # job key -> the workers it may run on
        self.checkpoints = CheckpointStore(checkpoint_path, keep=None)
        self.eval_dir = pathlib.Path(eval_dir)
        self.eval_dir.mkdir(parents=True, exist_ok=True)
        self._fs, _ = filesystem(str(self.eval_dir))
        state = self._read_state()
        self.corrupt_results: dict[int, str] = {}  # {version: problem}: set aside, evaluated again
        self.evaluated: list[int] = self._intact_results(state.get("evaluated", []))
        self.missing: list[int] = state.get("missing", [])
        #: ``{version: reason}`` of checkpoints given up on (unloadable, or jobs failed MAX_ATTEMPTS times).
        self.failed: dict[int, str] = {int(version): reason for version, reason in state.get("failed", {}).items()}
        self.jobs_run = 0
        self._attempts: dict[int, int] = {}
        self.worker_losses = 0  # jobs lost with their worker (retried, no attempt counted)
        self.service_state = ServiceState("evaluation chief", "the evaluation workers", policy,
                                          placement=self.placement)
        self.service_state.start()
        self._in_flight: dict[int, dict[tuple[str, int], Any]] = {}
        self._queue: list[tuple[int, str, int]] = []
        self._meta_leaves: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()
        self._pool = None if client is not None else concurrent.futures.ThreadPoolExecutor(eval_workers)
        self._writer = None
        if logdir is not None:
            from carlskit.summaries import SummaryWriter

            self._writer = SummaryWriter(logdir, flush_every_seconds=0.5)

    # ------------------------------------------------------------------ durable state
    def _read_state(self) -> dict:
        path = self.eval_dir / STATE_FILE
        if not path.exists():
            return {}
        state = loads_checked_json(path.read_bytes(), path)
        try:
            if not isinstance(state, dict):
                raise ValueError(f"expected a JSON object, got {type(state).__name__}")
            evaluated, missing = list(state.get("evaluated", [])), list(state.get("missing", []))
            failed = {int(version): str(reason) for version, reason in dict(state.get("failed", {})).items()}
            if not all(isinstance(v, int) for v in evaluated + missing):
                raise ValueError("'evaluated' and 'missing' must be lists of int")
        except (ValueError, TypeError) as error:  # intact bytes, but not what a chief writes
            raise CorruptFileError(path, f"not a carlskit evaluation state: {error}") from None
        return {"evaluated": evaluated, "missing": missing, "failed": failed}

    def _write_state(self) -> None:
        atomic_write(self._fs, str(self.eval_dir / STATE_FILE),
                     dumps_checked_json({"evaluated": sorted(self.evaluated), "missing": sorted(self.missing),
                                         "failed": {str(v): reason for v, reason in sorted(self.failed.items())}}))

    def result_path(self, version: int) -> pathlib.Path:
        return self.eval_dir / f"v{version:012d}.json"

    def _read_result(self, version: int) -> dict[str, dict[str, list[float]]]:
        path = self.result_path(version)
        document = loads_checked_json(path.read_bytes(), path)
        if not isinstance(document, dict) or document.get("version") != version \
                or not isinstance(document.get("curves"), dict):
            raise CorruptFileError(path, f"not the evaluation result of checkpoint {version}")
        return document["curves"]

    def _intact_results(self, evaluated: list[int]) -> list[int]:
        """The versions of ``evaluated`` whose result file is intact; the others are evaluated again."""
        intact = []
        for version in evaluated:
            try:
                self._read_result(version)
            except (CorruptFileError, FileNotFoundError) as error:
                problem = error.problem if isinstance(error, CorruptFileError) else "result file missing"
                self.corrupt_results[version] = problem
                logger.error("evaluation result of checkpoint %d unusable (%s): evaluating it again", version, problem)
                continue
            intact.append(version)
        return intact

    def results(self) -> dict[int, dict[str, dict[str, list[float]]]]:
        """Every evaluated checkpoint's curves ``{version: {task_set: {split: curve}}}`` (from disk,
        checksums checked: a result damaged since is left out and recorded in ``corrupt_results``)."""
        results = {}
        for version in sorted(self.evaluated):
            try:
                results[version] = self._read_result(version)
            except (CorruptFileError, FileNotFoundError) as error:
                self.corrupt_results[version] = getattr(error, "problem", "result file missing")
        return results

    # ------------------------------------------------------------------ one round
    def poll(self) -> list[int]:
        """Enqueue jobs for new checkpoints, collect finished jobs; returns versions completed now."""
        with self._lock:
            if self.gave_up is not None:
                return []
            known = set(self.evaluated) | set(self.missing) | set(self.failed) | set(self._in_flight)
            for version in self.checkpoints.versions():
                if version not in known:
                    self._enqueue(version)
            self._submit_queued()
            return self._collect()

    def _fail(self, version: int, reason: str) -> None:
        """Give up on ``version`` for good (recorded durably with ``reason``); the others go on."""
        self.failed[version] = reason
        self._attempts.pop(version, None)
        self._meta_leaves.pop(version, None)
        self._write_state()
        logger.error("checkpoint %d not evaluated: %s", version, reason)

    def _enqueue(self, version: int) -> None:
        try:
            meta_params, _ = load_meta_params_checkpoint(self.checkpoints, self.rule, version)
        except FileNotFoundError:  # pruned before we saw it: record it, never wait for it
            self.missing.append(version)
            self._write_state()
            logger.warning("checkpoint %d disappeared before evaluation", version)
            return
        except Exception as error:  # corrupt, or written for another rule: never blocks the others
            self._fail(version, f"cannot load checkpoint: {type(error).__name__}: {error}")
            return
        self._attempts[version] = self._attempts.get(version, 0) + 1
        self._meta_leaves[version] = [np.asarray(leaf) for leaf in jax.tree.leaves(meta_params)]
        self._in_flight[version] = {}
        # Newest checkpoint first: the live view shows the latest curves soon; older ones follow.
        self._queue[0:0] = [(version, task_set.name, index)
                            for task_set in self.task_sets for index in range(len(task_set.tasks))]

    def _submit_queued(self) -> None:
        running = sum(1 for jobs in self._in_flight.values() for job in jobs.values() if not job.done())
        while self._queue and running < self.eval_workers and self.service_state.ready():
            version, set_name, index = self._queue.pop(0)
            task_set = next(s for s in self.task_sets if s.name == set_name)
            arguments = (self.rule, self._meta_leaves[version], task_set.tasks[index], task_set.seed,
                         task_set.num_instances, task_set.num_steps, self.time_scale)
            if self.client is None:
                job = self._pool.submit(evaluate_job, *arguments)
            else:
                allowed = self.placement.candidates(self.client)
                if not allowed:  # none of its workers is up (yet): try again at the next poll
                    self._queue.insert(0, (version, set_name, index))
                    return
                job = self.client.submit(evaluate_job, *arguments, pure=False, workers=allowed,
                                         allow_other_workers=False)
                self._allowed[job.key] = set(allowed)
            self._in_flight[version][(set_name, index)] = job
            running += 1

    def _cancel_orphans(self) -> None:
        """Cancel jobs whose allowed workers are all gone (Dask would wait for them forever)."""
        if self.client is None or not self._allowed:
            return
        live = set(live_workers(self.client))
        for jobs in self._in_flight.values():
            for job in jobs.values():
                allowed = self._allowed.get(job.key)
                if allowed is not None and not job.done() and not allowed & live:
                    job.cancel()  # a cancelled job counts as lost with its worker (by type)
        in_flight = {job.key for jobs in self._in_flight.values() for job in jobs.values()}
        for key in [key for key in self._allowed if key not in in_flight]:
            del self._allowed[key]

    def _collect(self) -> list[int]:
        self._cancel_orphans()
        completed = []
        for version in sorted(self._in_flight):
            jobs = self._in_flight[version]
            expected = sum(len(s.tasks) for s in self.task_sets)
            if len(jobs) < expected or not all(job.done() for job in jobs.values()):
                continue
            try:
                outcomes = {name: job.result() for name, job in jobs.items()}
            except Exception as error:  # a job failed: run this checkpoint's jobs again, MAX_ATTEMPTS in all
                del self._in_flight[version]
                self._queue = [entry for entry in self._queue if entry[0] != version]
                if is_worker_loss(error):  # not the checkpoint's fault: no attempt, retried under the policy
                    self.worker_losses += 1
                    self._attempts[version] = self._attempts.get(version, 1) - 1
                    if self.service_state.failed(error, "evaluation jobs kept being lost with their workers") is None:
                        return completed
                    logger.warning("evaluation job of checkpoint %d lost with its worker (%r); retrying",
                                   version, error)
                    self._enqueue(version)
                    continue
                attempts = self._attempts.get(version, 0)
                if attempts >= MAX_ATTEMPTS:
                    self._fail(version, f"evaluation failed {attempts} times, last: {type(error).__name__}: {error}")
                else:
                    logger.error("evaluation of checkpoint %d failed (%r); retrying", version, error)
                    self._enqueue(version)
                continue
            self.jobs_run += len(jobs)
            curves = {s.name: {split: np.mean([outcomes[(s.name, i)][split] for i in range(len(s.tasks))],
                                              axis=0).tolist() for split in SPLITS} for s in self.task_sets}
            atomic_write(self._fs, str(self.result_path(version)),
                         dumps_checked_json({"version": version, "wall_time": time.time(), "curves": curves}))
            self.service_state.recovered()
            self.corrupt_results.pop(version, None)
            self.evaluated.append(version)
            self._write_state()  # after the results: a crash in between re-evaluates, never skips
            del self._in_flight[version]
            self._meta_leaves.pop(version, None)
            self._attempts.pop(version, None)
            self._summarize(version, curves)
            completed.append(version)
            if self.on_result is not None:
                self.on_result(version, curves)
        if completed:
            self._submit_queued()
        return completed

    def _summarize(self, version: int, curves: dict) -> None:
        if self._writer is None:
            return
        for set_name, splits in curves.items():
            for split, curve in splits.items():
                self._writer.scalar(f"eval/{set_name}/{split}_final", curve[-1], version)
                self._writer.scalar(f"eval/{set_name}/{split}_mean", float(np.mean(curve)), version)

    def wait(self, version: int, timeout: float = 120.0, poll_seconds: float = 0.05) -> None:
        """Poll until ``version`` is evaluated (for scripts and tests); ``TimeoutError`` otherwise, and
        ``RuntimeError`` (with the reason) if the chief gave up on it."""
        deadline = time.monotonic() + timeout
        while version not in self.evaluated:
            if version in self.failed:
                raise RuntimeError(f"checkpoint {version} failed evaluation: {self.failed[version]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"checkpoint {version} not evaluated within {timeout:g} s")
            self.poll()
            time.sleep(poll_seconds)

    def best_checkpoint(self, task_set: str | None = None, split: str = "valid") -> int:
        """The evaluated version with the lowest mean ``split`` loss on ``task_set`` (default: first set)."""
        task_set = self.task_sets[0].name if task_set is None else task_set
        results = self.results()
        if not results:
            raise ValueError("no checkpoint has been evaluated yet")
        return min(results, key=lambda v: float(np.mean(results[v][task_set][split])))

    @property
    def gave_up(self) -> str | None:
        """The give-up message once worker losses outlasted the restart budget, else ``None``."""
        return self.service_state.gave_up

    def check(self) -> None:
        """Raise :class:`carlskit.ServiceGaveUpError` if the chief gave up (workers kept being lost)."""
        self.service_state.check()

    def supervision(self) -> ServiceStatus:
        """The evaluation workers' :class:`carlskit.cluster.ServiceStatus` (with ``worker_losses``)."""
        return self.service_state.status(worker_losses=self.worker_losses)

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {"evaluated": len(self.evaluated), "latest_evaluated": max(self.evaluated, default=None),
                    "in_flight": sorted(self._in_flight), "queued_jobs": len(self._queue),
                    "missing": list(self.missing), "failed": dict(self.failed), "jobs_run": self.jobs_run,
                    "corrupt_results": dict(self.corrupt_results), "worker_losses": self.worker_losses,
                    "gave_up": self.gave_up}

    def close(self) -> None:
        """Drop queued and in-flight work (a new chief redoes it) and flush summaries."""
        with self._lock:
            for jobs in self._in_flight.values():
                for job in jobs.values():
                    job.cancel()
            self._in_flight.clear()
            self._queue.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._writer is not None:
            self._writer.close()
