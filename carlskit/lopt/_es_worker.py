"""The ES worker loop of the meta-training cluster (Metz et al. 2022, Appendix H.1).

Each round: fetch ``(outer_step, meta_params)`` from the learner, sample a task structure from the
family, estimate the outer gradient by antithetic full-unroll ES over ``num_tasks`` vectorized task
instances (:func:`carlskit.lopt.make_full_es_estimator`), and put the record into the gradient
store under a unique id (batched: ``put_every`` records per call). A round in which every pair
diverged (``outer_loss`` NaN, zero gradient) is counted and logged, not put. Meta-parameters from
the learner that do not fit ``rule`` end the loop with a ValueError naming the leaf. An exception raised while
estimating is logged, counted and reported, and the loop continues; losing the learner or the
store (their worker died) ends the loop with that error: its supervisor (``MetaTraining``'s
:class:`carlskit.cluster._supervised.LongRunningTasks` with ``hold``) keeps it waiting, with no
failure counted, until the learner is rebuilt, then relaunches it with the new actors.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import time
import traceback
import uuid
from typing import Any

import jax
import numpy as np

from carlskit.cluster._supervised import log_worker_event, secede_if_on_worker
from carlskit.lopt._checks import check_meta_params, positive_float, positive_int
from carlskit.lopt._estimators import make_full_es_estimator
from carlskit.lopt._gradient_store import call
from carlskit.lopt._inner import check_aggregation
from carlskit.lopt._learner import meta_params_structure

logger = logging.getLogger("carlskit.lopt.workers")


@dataclasses.dataclass(frozen=True)
class ESWorkerConfig:
    """What every ES worker estimates: ``num_tasks`` antithetic pairs, ``num_steps`` inner steps each."""

    num_tasks: int = 8
    num_steps: int = 50
    std: float = 0.01
    aggregation: str = "mean"
    put_every: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_tasks", "num_steps", "put_every"):
            object.__setattr__(self, name, positive_int(getattr(self, name), name))
        object.__setattr__(self, "std", positive_float(self.std, "std"))
        check_aggregation(self.aggregation)
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {self.seed!r}")
        object.__setattr__(self, "seed", int(self.seed))


def report_event(topic: str, message: dict) -> None:
    """A small status message for the client (a Dask event when on a worker, else a log line)."""
    if not log_worker_event(topic, message):
        logger.debug("%s: %s", topic, message)


def task_label(task: Any) -> str:
    """The task family name a gradient is filed under: the task structure's repr."""
    return repr(task)


def run_es_worker(index: int, learner: Any, store: Any, family: Any, rule: Any, config: ESWorkerConfig,
                  stop: Any, topic: str, logdir: str | None = None, max_rounds: int | None = None) -> int:
    """Estimate and store outer gradients until ``stop`` is set; returns the records put."""
    secede_if_on_worker()
    treedef, _ = meta_params_structure(rule)
    # A relaunched worker must not repeat its predecessor's perturbations: fresh entropy per start.
    start_entropy = uuid.uuid4().int & 0xFFFFFFFF
    rng = np.random.default_rng([config.seed, index, start_entropy])
    key = jax.random.PRNGKey(int(rng.integers(2**31)))
    estimators: dict[Any, Any] = {}
    writer = None
    if logdir is not None:
        from carlskit.summaries import SummaryWriter

        writer = SummaryWriter(logdir, flush_every_seconds=1.0, seed=None)
    pending: list[dict] = []
    put, rounds, errors, diverged = 0, 0, 0, 0
    try:
        while not stop.is_set() and (max_rounds is None or rounds < max_rounds):
            rounds += 1
            outer_step, leaves = call(learner, "current")
            # A learner whose meta-parameters do not fit ``rule`` is a configuration error, not a
            # failed round: it ends the loop (ValueError naming the leaf) instead of being retried.
            meta_params = jax.tree.unflatten(treedef, leaves)
            check_meta_params(rule, meta_params, "learner meta_params")
            try:
                started = time.perf_counter()
                task = family.sample(rng)
                if task not in estimators:
                    estimators[task] = make_full_es_estimator(rule, task, num_tasks=config.num_tasks,
                                                              num_steps=config.num_steps, std=config.std,
                                                              aggregation=config.aggregation)
                key, step_key = jax.random.split(key)
                grad, metrics = estimators[task](meta_params, step_key)
                record = {"id": f"{index}-{uuid.uuid4().hex}", "grad": [np.asarray(g) for g in jax.tree.leaves(grad)],
                          "outer_step": int(outer_step), "task_family": task_label(task),
                          "losses": np.asarray(metrics["pair_losses"]), "outer_loss": float(metrics["outer_loss"]),
                          "worker": index, "seconds": time.perf_counter() - started}
            except Exception as error:  # the worker's own failure: log it, count it, go on
                errors += 1
                logger.error("ES worker %d: %s", index, "".join(traceback.format_exception(error)))
                report_event(topic, {"worker": index, "error": f"{type(error).__name__}: {error}"})
                if writer is not None:
                    writer.scalar(f"worker{index}/errors", errors, rounds)
                continue
            if not np.isfinite(record["outer_loss"]):  # every pair diverged: the zero gradient says nothing
                diverged += 1
                logger.warning("ES worker %d: every pair diverged on %s; no record put", index, record["task_family"])
                if writer is not None:
                    writer.scalar(f"worker{index}/diverged_rounds", diverged, rounds)
                continue
            pending.append(record)
            if len(pending) >= config.put_every:
                put += call(store, "put_many", pending)
                pending = []
            if writer is not None:
                writer.scalar(f"worker{index}/outer_loss", record["outer_loss"], outer_step)
                writer.scalar(f"worker{index}/estimate_seconds", record["seconds"], outer_step)
        if pending:
            put += call(store, "put_many", pending)
    finally:
        if writer is not None:
            writer.close()
    return put
