"""``Learner``: applies averaged, fresh-enough ES gradients to the meta-parameters (Metz et al. 2020,
Appendix H.1). A Dask actor in cluster mode, a plain (thread-safe) object in-process.

One update (``update()``), the learner half of the outer core
(:func:`carlskit.lopt._outer.learner_apply`, the same call ``meta_train`` makes):

    records  = store.take_many(max_gradients_per_update)
    valid    = well-formed records whose grad has the meta-parameters' leaf shapes and finite values
    fresh    = valid records with  0 <= outer_step_learner - record.outer_step <= max_staleness
    g        = mean over fresh of record.grad
    theta, s = optax outer optimizer (Adam by default) applied to g;  outer_step += 1

Rejected records (malformed, grad of the wrong shape or a non-numeric dtype, non-finite grad,
``outer_step`` not an int >= 0 or one the learner has not reached, ``outer_loss`` not a finite
number, ``task_family`` not a str) and stale gradients are counted per reason, never applied; the
good records of the same batch are applied. An update that would make the meta-parameters
non-finite raises ``FloatingPointError`` and changes nothing (the driver counts it as a learner
error). Meta-parameters and the outer optimizer's state are
checkpointed through :class:`carlskit.training.CheckpointStore` (version = outer step) every
``checkpoint_every_seconds``; a new learner over the same directory resumes from the newest *intact*
one: a checkpoint that cannot be read (corrupt, or not fitting the rule) is recorded in
``skipped_checkpoints`` with its reason and the next older one is tried; when none can be read the
learner refuses to start (the error of the newest), never silently starting over from scratch.

Per task family (:mod:`carlskit.lopt._monitoring`, Metz et al. 2020 App. H.1) the learner keeps the
loss over all records so far and in the latest update, and the outer-gradient variance; they are in
``status()["families"]``, in the checkpoint metadata, and written as ``family/<task_family>/loss_all``,
``.../loss_latest`` and ``.../grad_variance`` summaries at the steps that applied the family.

Summaries (``learner/*``, step = outer step) are written once per step. A learner resumed from
checkpoint ``c`` re-reaches steps ``c + 1 .. s`` that its predecessor had already logged before it
was lost (``s``: the highest ``learner/*`` step on disk). Rule: *the first write of a step stands*;
the resumed learner writes only steps ``> max(c, s)`` (``summary_floor``), so no step appears twice
and no logged value is overwritten. Steps ``c + 1 .. s`` keep the values of the lost learner's
trajectory (what really ran then); steps its writer had not flushed when it died (at most
``flush_every_seconds``, 0.5 s, of updates) are written by the resumed learner.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from carlskit._checks import integer, positive_float, positive_int
from carlskit.checkpoints import CheckpointStore
from carlskit.lopt._checks import check_meta_params
from carlskit.lopt._gradient_store import call
from carlskit.lopt._monitoring import family_summary, summary_label, update_family_stats
from carlskit.lopt._outer import (
    REJECTION_REASONS,
    LearnerConfig,
    LearnerState,
    Verdict,
    learner_apply,
    outer_optimizer_of,
)
from carlskit.lopt._protocols import UpdateRule
from carlskit.lopt._rule_config import rule_to_config

logger = logging.getLogger("carlskit.lopt.learner")

PyTree = Any
STALENESS_BINS = 16  # staleness 0..14, and 15+ in the last bin
FAMILY_LOSS_DECAY = 0.9
SUMMARY_SCALARS = ("learner/outer_loss", "learner/gradients_per_second", "learner/dropped_fraction",
                   "learner/update_seconds")


def load_newest_intact(checkpoints: CheckpointStore, load: Any, skipped: dict[int, str] | None = None
                       ) -> tuple[int, Any] | None:
    """``(version, load(version))`` for the newest checkpoint that loads, or ``None`` when there is none.

    The reader of a series: a checkpoint that cannot be read (``ValueError``: corrupt, which
    includes :class:`carlskit.CorruptFileError`, or written for another rule) is skipped, logged and
    recorded in ``skipped`` with its reason, and the one before it is tried; if every one fails,
    the newest's error is raised (never a silent fresh start).
    """
    first_error: Exception | None = None
    for version in reversed(checkpoints.versions()):
        try:
            return int(version), load(version)
        except FileNotFoundError:  # pruned between listing and reading
            continue
        except ValueError as error:
            first_error = first_error or error
            if skipped is not None:
                skipped[int(version)] = f"{type(error).__name__}: {error}"
            logger.error("checkpoint %d unreadable, trying the one before: %s", version, error)
    if first_error is not None:
        raise first_error
    return None


def last_logged_step(logdir: str) -> int:
    """The highest step of the learner's scalar summaries in ``logdir`` (``-1`` when there are none).

    Reads the log once (when a learner resumes); damaged records are skipped, not trusted."""
    from carlskit.summaries import SummaryReader

    reader = SummaryReader(logdir, on_corrupt="skip")
    steps = [reader.scalars(name)["step"] for name in SUMMARY_SCALARS]
    return max((int(column.max()) for column in steps if len(column)), default=-1)


class Learner:
    """Poll the gradient store, drop stale gradients, average the rest, apply the outer optimizer.

    Args:
      rule: the learned optimizer's update rule (defines the meta-parameters' structure).
      store: a :class:`GradientStore` or its Dask actor.
      checkpoint_path: directory (or fsspec URL) of the meta-parameter checkpoints.
      initial_meta_params: where to start when there is no checkpoint yet (default
        ``rule.init_meta_params(PRNGKey(seed))``).
      outer_optimizer: optax transformation on the meta-parameters (default ``optax.adam(3e-3)``), or
        ``"self"``: the learned optimizer the current meta-parameters define (:func:`self_optimizer`).
      max_staleness: gradients more than this many outer steps old are dropped (paper: 5).
      max_gradients_per_update: records taken from the store per update.
      checkpoint_every_seconds: checkpoint period (paper: 10 minutes).
      logdir: summaries directory (``None``: no summaries).
    """

    def __init__(self, rule: UpdateRule, store: Any, checkpoint_path: str, *, initial_meta_params: PyTree | None = None,
                 outer_optimizer: optax.GradientTransformation | str | None = None, max_staleness: int = 5,
                 max_gradients_per_update: int = 64, checkpoint_every_seconds: float = 600.0,
                 logdir: str | None = None, seed: int = 0, keep_checkpoints: int | None = None) -> None:
        self.max_staleness = integer(max_staleness, "max_staleness", 0)
        self.max_gradients_per_update = positive_int(max_gradients_per_update, "max_gradients_per_update")
        self.checkpoint_every_seconds = positive_float(checkpoint_every_seconds, "checkpoint_every_seconds")
        seed = integer(seed, "seed", 0)
        self.rule, self.store = rule, store
        self.outer_optimizer = outer_optimizer_of(outer_optimizer, rule)
        self.config = LearnerConfig.of(rule, self.outer_optimizer, self.max_staleness)
        self._lock = threading.Lock()

        if initial_meta_params is None:
            template = rule.init_meta_params(jax.random.PRNGKey(seed))
        else:  # a tree of the wrong structure is a ValueError here (documented; as_optax says TypeError)
            check_meta_params(rule, initial_meta_params, "initial_meta_params", finite=True, structure_error=ValueError)
            template = jax.tree.map(jnp.asarray, initial_meta_params)
        # Only now, with every argument checked, touch the checkpoint directory (creating it).
        self.checkpoints = CheckpointStore(checkpoint_path, keep=keep_checkpoints)
        self.stats: dict[str, Any] = {"received": 0, "applied": 0, "dropped_stale": 0, "updates": 0,
                                      "rejected": dict.fromkeys(REJECTION_REASONS, 0),
                                      "staleness_counts": [0] * STALENESS_BINS, "family_losses": {},
                                      "families": {}}
        self.last_outer_loss = float("nan")
        self._last_checkpoint_time = time.time()
        #: ``{version: reason}`` of checkpoints newer than the one resumed from that could not be read.
        self.skipped_checkpoints: dict[int, str] = {}
        target = {"meta_params": template, "outer_state": self.outer_optimizer.init(template)}
        resumed = load_newest_intact(self.checkpoints, lambda v: self.checkpoints.load(v, target=target),
                                     self.skipped_checkpoints)
        if resumed is None:
            self.meta_params, self.outer_state, self.outer_step = template, self.outer_optimizer.init(template), 0
            self.resumed_from = None
            self._save_checkpoint()
        else:
            version, (tree, metadata) = resumed
            self.meta_params, self.outer_state = tree["meta_params"], tree["outer_state"]
            self.outer_step, self.resumed_from = version, version
            for name in self.stats:
                if name in metadata.get("learner", {}):
                    saved = metadata["learner"][name]
                    # Reasons added since that checkpoint was written start at 0.
                    self.stats[name] = {**self.stats[name], **saved} if name == "rejected" else saved
        self.last_update_seconds = self._update_seconds_total = 0.0
        self._timed_updates = 0
        self._accepted_times: collections.deque = collections.deque(maxlen=256)
        self._started = time.time()
        self._writer = None
        self.summary_floor = -1  # steps <= this are not logged (already on disk: the first write stands)
        self.summaries_skipped = 0
        if logdir is not None:
            from carlskit.summaries import SummaryWriter

            if self.resumed_from is not None:
                self.summary_floor = max(self.resumed_from, last_logged_step(logdir))
            self._writer = SummaryWriter(logdir, flush_every_seconds=0.5)

    # ------------------------------------------------------------------ serving workers
    def current(self) -> tuple[int, list[np.ndarray]]:
        """``(outer_step, leaves)``: the meta-parameters workers should estimate gradients at."""
        with self._lock:
            return self.outer_step, [np.asarray(leaf) for leaf in jax.tree.leaves(self.meta_params)]

    # ------------------------------------------------------------------ one update
    def update(self) -> dict[str, Any]:
        """Take a batch from the store and apply one outer step if any gradient is fresh enough
        (:func:`carlskit.lopt._outer.learner_apply`).

        Returns this update's figures: ``taken``, ``applied``, ``dropped_stale``, ``rejected``,
        ``outer_step``, ``seconds`` (learner overhead: validation, averaging, optimizer, checkpoint).
        """
        records = call(self.store, "take_many", self.max_gradients_per_update)
        with self._lock:
            started = time.perf_counter()
            # The new state is built aside and committed only at the end, so a failure part way
            # leaves the learner as it was (and a bad record never costs good ones).
            state = LearnerState(self.meta_params, self.outer_state, self.outer_step)
            new_state, verdict = learner_apply(state, records, self.config)
            for record, reason in verdict.rejected:
                where = record if isinstance(record, dict) else {}
                logger.warning("learner rejected gradient %r from worker %r: %s", where.get("id"),
                               where.get("worker"), reason)
            if verdict.fresh:
                jax.block_until_ready(new_state.meta_params)
                self._commit(new_state, verdict.fresh)
            self._count(verdict)
            if self._due_for_checkpoint():
                self._save_checkpoint()
            seconds = time.perf_counter() - started
            if records:
                self.last_update_seconds = seconds
                self._update_seconds_total += seconds
                self._timed_updates += 1
            result = {"taken": len(records), "applied": len(verdict.fresh), "dropped_stale": verdict.stale,
                      "rejected": len(verdict.rejected), "outer_step": self.outer_step, "seconds": seconds}
        if verdict.fresh:
            self._log_summaries(verdict.staleness)
        return result

    def _commit(self, state: LearnerState, fresh: list[dict]) -> None:
        """Take ``state`` and the per-family losses of the ``fresh`` records that made it."""
        losses = [float(r["outer_loss"]) for r in fresh]
        family_losses = {name: dict(values) for name, values in self.stats["family_losses"].items()}
        for record, loss in zip(fresh, losses):
            family = family_losses.setdefault(record["task_family"], {"loss": None, "count": 0})
            family["loss"] = loss if family["loss"] is None else (
                FAMILY_LOSS_DECAY * family["loss"] + (1 - FAMILY_LOSS_DECAY) * loss)
            family["count"] += 1
        self.stats["families"] = update_family_stats(self.stats["families"], fresh, state.outer_step)
        self.meta_params, self.outer_state, self.outer_step = state
        self.stats["applied"] += len(fresh)
        self.stats["updates"] += 1
        self.stats["family_losses"] = family_losses
        self.last_outer_loss = float(np.mean(losses))
        self._accepted_times.extend([time.time()] * len(fresh))

    def _count(self, verdict: Verdict) -> None:
        for _, reason in verdict.rejected:
            self.stats["rejected"][reason] += 1
        self.stats["received"] += len(verdict.staleness)
        for age in verdict.staleness:
            self.stats["staleness_counts"][min(age, STALENESS_BINS - 1)] += 1
        self.stats["dropped_stale"] += verdict.stale

    # ------------------------------------------------------------------ checkpoints
    def _due_for_checkpoint(self) -> bool:
        latest = self.checkpoints.latest()
        return (latest is None or self.outer_step > latest) and \
            time.time() - self._last_checkpoint_time >= self.checkpoint_every_seconds

    def _save_checkpoint(self) -> int:
        metadata = {"learner": self.stats, "outer_step": self.outer_step, "rule": rule_to_config(self.rule),
                    "outer_loss": self.last_outer_loss if np.isfinite(self.last_outer_loss) else None}
        self.checkpoints.save({"meta_params": self.meta_params, "outer_state": self.outer_state},
                              version=self.outer_step, metadata=metadata)
        self._last_checkpoint_time = time.time()
        return self.outer_step

    def checkpoint_now(self) -> int | None:
        """Write a checkpoint if the outer step moved since the last one; returns the latest version."""
        with self._lock:
            latest = self.checkpoints.latest()
            if latest is None or self.outer_step > latest:
                return self._save_checkpoint()
            return latest

    # ------------------------------------------------------------------ reporting
    def gradients_per_second(self, window_seconds: float = 10.0) -> float:
        now = time.time()
        recent = [t for t in self._accepted_times if now - t <= window_seconds]
        span = min(window_seconds, now - self._started)
        return len(recent) / span if span > 0 else 0.0

    def _log_summaries(self, staleness: list[int]) -> None:
        if self._writer is None:
            return
        step = self.outer_step
        if step <= self.summary_floor:  # logged by the learner this one replaced: the first write stands
            self.summaries_skipped += 1
            return
        received = max(self.stats["received"], 1)
        self._writer.scalar("learner/outer_loss", self.last_outer_loss, step)
        self._writer.scalar("learner/gradients_per_second", self.gradients_per_second(), step)
        self._writer.scalar("learner/dropped_fraction", self.stats["dropped_stale"] / received, step)
        self._writer.scalar("learner/update_seconds", self.last_update_seconds, step)
        self._writer.array("learner/staleness", np.asarray(staleness, np.float64), step, bins=STALENESS_BINS)
        # Per task family (Metz et al. 2020, App. H.1), for the families this update applied.
        for row in family_summary(self.stats["families"]):
            if row["latest_step"] != step:
                continue
            label = summary_label(row["task_family"])
            for key in ("loss_latest", "loss_all", "grad_variance"):
                if row[key] is not None:
                    self._writer.scalar(f"family/{label}/{key}", row[key], step)

    def status(self) -> dict[str, Any]:
        with self._lock:
            received = self.stats["received"]
            return {"outer_step": self.outer_step, "resumed_from": self.resumed_from,
                    "outer_loss": self.last_outer_loss, "gradients_per_second": self.gradients_per_second(),
                    "received": received, "applied": self.stats["applied"],
                    "dropped_stale": self.stats["dropped_stale"],
                    "dropped_fraction": self.stats["dropped_stale"] / received if received else 0.0,
                    "rejected": dict(self.stats["rejected"]),
                    "staleness_counts": list(self.stats["staleness_counts"]),
                    "family_losses": {k: dict(v) for k, v in self.stats["family_losses"].items()},
                    "families": family_summary(self.stats["families"]),
                    "update_seconds": self.last_update_seconds,
                    "mean_update_seconds": self._update_seconds_total / max(self._timed_updates, 1),
                    "update_seconds_total": self._update_seconds_total, "timed_updates": self._timed_updates,
                    "latest_checkpoint": self.checkpoints.latest(),
                    "skipped_checkpoints": dict(self.skipped_checkpoints), "summary_floor": self.summary_floor,
                    "summaries_skipped": self.summaries_skipped}

    def close(self) -> None:
        """Checkpoint the latest meta-parameters and flush summaries."""
        self.checkpoint_now()
        if self._writer is not None:
            self._writer.close()
