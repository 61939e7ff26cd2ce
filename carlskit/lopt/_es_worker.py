"""The ES worker loop of the meta-training cluster (Metz et al. 2020, Appendix H.1).

Each round: fetch ``(outer_step, meta_params)`` from the learner, take that step's task structure
and keys from the worker's :class:`carlskit.lopt._outer.OuterStream`, estimate the outer gradient
by antithetic full-unroll ES over ``num_tasks`` vectorized task instances
(:func:`carlskit.lopt._outer.worker_estimate`, the same call ``meta_train`` makes), and put the
record into the gradient store (batched: ``put_every`` records per call). A round in which every
pair diverged (``outer_loss`` NaN, zero gradient) is counted and logged, not put. Meta-parameters
from the learner that do not fit ``rule`` end the loop with a ValueError naming the leaf. An
exception raised while estimating is logged, counted and reported, and the loop continues; losing
the learner or the store (their worker died) ends the loop with that error: its supervisor
(``MetaTraining``'s :class:`carlskit.cluster.LongRunningTasks` with ``hold``) keeps it
waiting, with no failure counted, until the learner is rebuilt, then relaunches it with the new
actors (the next ``launch``: a stream of its own).
"""

from __future__ import annotations

import dataclasses
import logging
import traceback
from typing import Any

import jax

from carlskit._checks import integer, positive_float, positive_int
from carlskit.cluster import log_worker_event, secede_if_on_worker
from carlskit.lopt._checks import check_meta_params
from carlskit.lopt._gradient_store import call
from carlskit.lopt._inner import check_aggregation
from carlskit.lopt._outer import Estimators, OuterStream, informative, meta_params_structure, worker_estimate
from carlskit.lopt._protocols import TaskFamily, UpdateRule

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
        object.__setattr__(self, "seed", integer(self.seed, "seed", 0))


def report_event(topic: str, message: dict) -> None:
    """A small status message for the client (a Dask event when on a worker, else a log line)."""
    if not log_worker_event(topic, message):
        logger.debug("%s: %s", topic, message)


class _Rounds:
    """Which round at the current outer step a worker is in (0 for the first estimate at a step)."""

    def __init__(self) -> None:
        self.step, self.round = -1, 0

    def at(self, outer_step: int) -> int:
        self.round = self.round + 1 if outer_step == self.step else 0
        self.step = outer_step
        return self.round


def run_es_worker(index: int, learner: Any, store: Any, family: TaskFamily, rule: UpdateRule, config: ESWorkerConfig,
                  stop: Any, topic: str, logdir: str | None = None, max_rounds: int | None = None,
                  launch: int = 0) -> int:
    """Estimate and store outer gradients until ``stop`` is set; returns the records put.

    ``launch`` counts the runs of worker ``index`` (its supervisor's relaunches): each draws its
    own :class:`OuterStream`, worker 0's first the one ``meta_train`` draws for ``config.seed``."""
    secede_if_on_worker()
    treedef, _ = meta_params_structure(rule)
    stream, rounds_at = OuterStream.for_worker(family, config.seed, index, launch), _Rounds()
    estimators = Estimators(rule, "es", num_tasks=config.num_tasks, num_steps=config.num_steps, std=config.std,
                            aggregation=config.aggregation)
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
                task, key, _ = stream.at(int(outer_step), rounds_at.at(int(outer_step)))
                record = worker_estimate(estimators, meta_params, task, key, outer_step, worker=index)
            except Exception as error:  # the worker's own failure: log it, count it, go on
                errors += 1
                logger.error("ES worker %d: %s", index, "".join(traceback.format_exception(error)))
                report_event(topic, {"worker": index, "error": f"{type(error).__name__}: {error}"})
                _scalar(writer, f"worker{index}/errors", errors, rounds)
                continue
            if not informative(record):  # every pair diverged: the zero gradient says nothing
                diverged += 1
                logger.warning("ES worker %d: every pair diverged on %s; no record put", index, record["task_family"])
                _scalar(writer, f"worker{index}/diverged_rounds", diverged, rounds)
                continue
            pending.append(record)
            if len(pending) >= config.put_every:
                put += call(store, "put_many", pending)
                pending = []
            _scalar(writer, f"worker{index}/outer_loss", record["outer_loss"], outer_step)
            _scalar(writer, f"worker{index}/estimate_seconds", record["seconds"], outer_step)
        if pending:
            put += call(store, "put_many", pending)
    finally:
        if writer is not None:
            writer.close()
    return put


def _scalar(writer: Any, name: str, value: float, step: int) -> None:
    if writer is not None:
        writer.scalar(name, value, step)
