"""The outer step of meta-training, in one place (learned_optimization's ``SingleMachineGradientLearner``
split into its worker and learner halves).

    worker:   record = worker_estimate(estimators, meta_params, task, key, outer_step)
    learner:  state, verdict = learner_apply(state, records, config)

``worker_estimate`` runs an outer-gradient estimate (:class:`Estimators` builds one estimator per
task structure and keeps PES state) and packs it as a gradient *record* (the wire format of
:class:`GradientStore`). ``learner_apply`` judges records (well formed, fresh enough, finite),
averages the good ones and applies the outer optimizer; it returns a new :class:`LearnerState`
and never changes the one given. The NaN guard lives here once: a record whose every antithetic
pair diverged (``outer_loss`` NaN) is no information and is never applied, and meta-parameters
that an update makes non-finite raise ``FloatingPointError`` instead of being kept.

``LearnedOptimizer.meta_train`` is these two calls in a loop in one process; the ES workers call
the first and put the records into the gradient store, the :class:`Learner` takes them and calls
the second. :class:`OuterStream` gives both the same task and keys for an outer step, so with one
worker and no staleness the cluster reproduces ``meta_train`` for the same seed.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import uuid
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from carlskit._checks import choice, integer, positive_float, positive_int
from carlskit.lopt._estimators import make_full_es_estimator, make_pes_estimator
from carlskit.lopt._inner import check_aggregation
from carlskit.lopt._protocols import Task, TaskFamily, UpdateRule, uses_loss_and_num_steps

PyTree = Any
ESTIMATORS = ("es", "pes")
REJECTION_REASONS = ("malformed", "shape", "dtype", "non_finite", "outer_step", "future_step", "outer_loss",
                     "task_family")


# ----------------------------------------------------------------------------------- worker half
class Estimators:
    """One outer-gradient estimator per task structure (compiled once each), and PES state per structure.

    ``kind='es'``: antithetic ES through full unrolls of ``num_steps``; ``kind='pes'``: truncated
    PES, unrolls of ``truncation_length`` within episodes of ``num_steps`` inner steps (or, with
    ``min_num_steps``, episodes of lengths log-uniform over ``[min_num_steps, num_steps]``). The PES
    state persists per task structure for the life of this object: in the cluster, per worker and task.
    """

    def __init__(self, rule: UpdateRule, kind: str = "es", *, num_tasks: int, num_steps: int,
                 truncation_length: int | None = None, std: float = 0.01, aggregation: str = "mean",
                 min_num_steps: int | None = None) -> None:
        self.kind = choice(kind, "estimator", ESTIMATORS)
        self.rule = rule
        self.num_tasks, self.num_steps = positive_int(num_tasks, "num_tasks"), positive_int(num_steps, "num_steps")
        self.truncation_length = None if truncation_length is None else positive_int(truncation_length,
                                                                                     "truncation_length")
        if self.kind == "pes" and (self.truncation_length is None or self.num_steps % self.truncation_length):
            raise ValueError(f"horizon ({num_steps}) must be a multiple of truncation_length ({truncation_length})")
        self.std = positive_float(std, "std")
        check_aggregation(aggregation)
        self.aggregation = aggregation
        self.min_num_steps = None if min_num_steps is None else positive_int(min_num_steps, "min_num_steps")
        if self.min_num_steps is not None and (self.kind != "pes" or self.min_num_steps > self.num_steps):
            raise ValueError(f"min_num_steps ({min_num_steps}) needs estimator 'pes' and at most num_steps "
                             f"({num_steps}); got estimator {self.kind!r}")
        self._estimators: dict[Task, Any] = {}
        self._pes_states: dict[Task, Any] = {}

    def _estimator(self, task: Task) -> Any:
        if task not in self._estimators:
            common = dict(num_tasks=self.num_tasks, std=self.std, aggregation=self.aggregation)
            self._estimators[task] = (
                make_pes_estimator(self.rule, task, horizon=self.num_steps, truncation_length=self.truncation_length,
                                   min_horizon=self.min_num_steps, **common) if self.kind == "pes"
                else make_full_es_estimator(self.rule, task, num_steps=self.num_steps, **common))
        return self._estimators[task]

    def estimate(self, meta_params: PyTree, task: Task, key: jax.Array,
                 init_key: jax.Array | None = None) -> tuple[PyTree, dict[str, jax.Array]]:
        """``(grad, metrics)`` at ``meta_params`` on ``task``; PES starts the task's state from
        ``init_key`` (default: ``key``) the first time it sees the task."""
        estimator = self._estimator(task)
        if self.kind == "es":
            return estimator(meta_params, key)
        if task not in self._pes_states:
            self._pes_states[task] = estimator.init(meta_params, key if init_key is None else init_key)
        grad, self._pes_states[task], metrics = estimator.gradient(meta_params, key, self._pes_states[task])
        return grad, metrics


def worker_estimate(estimators: Estimators, meta_params: PyTree, task: Task, key: jax.Array, outer_step: int,
                    *, init_key: jax.Array | None = None, worker: int = 0) -> dict[str, Any]:
    """One gradient record (see :mod:`carlskit.lopt._gradient_store`) estimated at ``meta_params``,
    the learner's meta-parameters of ``outer_step``."""
    started = time.perf_counter()
    grad, metrics = estimators.estimate(meta_params, task, key, init_key)
    # The record is host data (it travels to the learner): one explicit transfer for all of it,
    # not one implicit transfer (and wait) per leaf and number.
    grad, losses, outer_loss, nan_fraction = jax.device_get(
        (jax.tree.leaves(grad), metrics["pair_losses"], metrics["outer_loss"], metrics["nan_fraction"]))
    return {"id": f"{worker}-{uuid.uuid4().hex}", "grad": [np.asarray(g) for g in grad],
            "outer_step": int(outer_step), "task_family": task_label(task),
            "losses": np.asarray(losses), "outer_loss": float(outer_loss),
            "nan_fraction": float(nan_fraction), "worker": worker,
            "seconds": time.perf_counter() - started}


def informative(record: dict[str, Any]) -> bool:
    """False when every antithetic pair of the estimate diverged: its (zero) gradient says nothing."""
    return bool(np.isfinite(record["outer_loss"]))


def task_label(task: Task) -> str:
    """The task family name a gradient is filed under: the task structure's repr."""
    return repr(task)


class OuterStream:
    """The task and keys of each outer step: ``next()`` in order (``meta_train``), or ``at(step)``
    for the learner's current step (an ES worker, which may be asked for a step again, or for an
    earlier one after the learner resumed from a checkpoint).

    Step ``s`` is the ``s``-th draw of ``family.sample(rng)`` and of ``key, step_key, init_key =
    split(key, 3)``. A worker's repeated rounds at one step (the learner had not moved yet) use the
    same task and ``fold_in(step_key, round)``, so they are new estimates, not copies.
    """

    def __init__(self, family: TaskFamily, key: jax.Array, rng_seed: Any) -> None:
        self.family, self._start = family, (key, rng_seed)
        self._reset()

    @classmethod
    def for_worker(cls, family: TaskFamily, seed: int, index: int, launch: int = 0) -> "OuterStream":
        """Worker ``index``'s stream in its ``launch``-th run: worker 0's first is ``meta_train``'s
        stream for ``seed``; every other (worker, launch) draws its own, so a relaunched worker does
        not repeat its predecessor's perturbations."""
        if index == 0 and launch == 0:
            return cls(family, jax.random.PRNGKey(seed), seed)
        return cls(family, jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), index), launch + 1),
                   [seed, index, launch + 1])

    def _reset(self) -> None:
        key, rng_seed = self._start
        self._key, self._rng, self.position, self._last = key, np.random.default_rng(rng_seed), 0, None

    def next(self) -> tuple[Task, jax.Array, jax.Array]:
        """``(task, step_key, init_key)`` of the next outer step."""
        task = self.family.sample(self._rng)
        self._key, step_key, init_key = jax.random.split(self._key, 3)
        self.position += 1
        self._last = (task, step_key, init_key)
        return self._last

    def at(self, outer_step: int, round_: int = 0) -> tuple[Task, jax.Array, jax.Array]:
        """``(task, step_key, init_key)`` of outer step ``outer_step`` (its ``round_``-th estimate)."""
        if outer_step < self.position - 1:
            self._reset()
        while self.position <= outer_step:
            self.next()
        task, step_key, init_key = self._last
        return (task, step_key, init_key) if round_ == 0 else (task, jax.random.fold_in(step_key, round_), init_key)


# ----------------------------------------------------------------------------------- learner half
class LearnerState(NamedTuple):
    """The learner's state: meta-parameters, the outer optimizer's state, updates applied so far."""

    meta_params: PyTree
    outer_state: PyTree
    outer_step: int


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    """What ``learner_apply`` needs: the outer optimizer, the staleness bound and the meta-parameters'
    treedef and leaf shapes (records carry flat leaves)."""

    optimizer: optax.GradientTransformation
    max_staleness: int
    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    apply: Callable = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_staleness", integer(self.max_staleness, "max_staleness", 0))
        object.__setattr__(self, "apply", jax.jit(functools.partial(_apply_gradient, self.optimizer)))

    @classmethod
    def of(cls, rule: UpdateRule, optimizer: optax.GradientTransformation, max_staleness: int = 0
           ) -> "LearnerConfig":
        treedef, shapes = meta_params_structure(rule)
        return cls(optimizer, max_staleness, treedef, tuple(shapes))

    def init(self, meta_params: PyTree, outer_step: int = 0) -> LearnerState:
        return LearnerState(meta_params, self.optimizer.init(meta_params), outer_step)


def meta_params_structure(rule: UpdateRule) -> tuple[Any, list[tuple[int, ...]]]:
    """Treedef and leaf shapes of ``rule``'s meta-parameters (no arrays are made)."""
    template = jax.eval_shape(rule.init_meta_params, jax.random.PRNGKey(0))
    leaves, treedef = jax.tree.flatten(template)
    return treedef, [tuple(leaf.shape) for leaf in leaves]


def _apply_gradient(optimizer, meta_params, outer_state, grad):
    updates, outer_state = optimizer.update(grad, outer_state, meta_params)
    return optax.apply_updates(meta_params, updates), outer_state


@dataclasses.dataclass
class Verdict:
    """How ``learner_apply`` judged a batch: the ``fresh`` records it applied (averaged), the
    ``rejected`` ones with their reason, the ages of the valid ones and how many were too ``stale``."""

    fresh: list[dict] = dataclasses.field(default_factory=list)
    rejected: list[tuple[Any, str]] = dataclasses.field(default_factory=list)
    staleness: list[int] = dataclasses.field(default_factory=list)
    stale: int = 0


def rejection(record: Any, outer_step: int, shapes: tuple[tuple[int, ...], ...]) -> str | None:
    """Why ``record`` cannot be applied at ``outer_step`` (one of ``REJECTION_REASONS``), or ``None``.

    Never raises."""
    try:
        if not isinstance(record, dict):
            return "malformed"
        grad = record.get("grad")
        if not isinstance(grad, (list, tuple)) or len(grad) != len(shapes):
            return "shape"
        arrays = [np.asarray(g) for g in grad]
        if tuple(array.shape for array in arrays) != tuple(shapes):
            return "shape"
        if not all(array.dtype.kind in "fiu" for array in arrays):
            return "dtype"  # str, object, complex, bool: not a gradient
        if not all(np.all(np.isfinite(array)) for array in arrays):
            return "non_finite"
        step = np.asarray(record.get("outer_step"))  # an int, numpy or 0-d array integer
        if step.ndim != 0 or step.dtype.kind not in "iu" or step < 0:
            return "outer_step"  # missing, None, str, bool, float (1.7 is no step), negative
        if step > outer_step:
            return "future_step"  # computed at a step this (restarted) learner has not reached
        loss = np.asarray(record.get("outer_loss"))
        if loss.ndim != 0 or loss.dtype.kind not in "fiu" or not np.isfinite(loss):
            return "outer_loss"  # missing, not a number, or NaN/inf (every pair of the estimate diverged)
        if not isinstance(record.get("task_family"), str):
            return "task_family"
    except Exception:  # e.g. a ragged nested list as a gradient leaf
        return "malformed"
    return None


def judge(state: LearnerState, records: list, config: LearnerConfig) -> Verdict:
    """Sort ``records`` into rejected (with reasons), too stale and fresh (applied)."""
    verdict = Verdict()
    for record in records:
        reason = rejection(record, state.outer_step, config.shapes)
        if reason is not None:
            verdict.rejected.append((record, reason))
            continue
        age = state.outer_step - int(record["outer_step"])
        verdict.staleness.append(age)
        if age > config.max_staleness:
            verdict.stale += 1
        else:
            verdict.fresh.append(record)
    return verdict


def learner_apply(state: LearnerState, records: list, config: LearnerConfig) -> tuple[LearnerState, Verdict]:
    """One outer step: the mean gradient of the fresh, valid ``records`` through the outer optimizer.

    Returns ``(new_state, verdict)``; ``state`` itself when no record is fresh. Raises
    ``FloatingPointError`` (``state`` untouched) when the update makes the meta-parameters non-finite.
    """
    verdict = judge(state, records, config)
    if not verdict.fresh:
        return state, verdict
    leaves = [np.mean([np.asarray(r["grad"][i], np.float32) for r in verdict.fresh], axis=0)
              for i in range(len(config.shapes))]
    # the records' mean gradient in by one explicit transfer (host arrays handed to the jitted
    # update would each be an implicit one)
    grad = jax.device_put(jax.tree.unflatten(config.treedef, leaves))
    meta_params, outer_state = config.apply(state.meta_params, state.outer_state, grad)
    if not all_finite(meta_params):
        raise FloatingPointError(f"the meta-parameters became non-finite at outer step {state.outer_step}; "
                                 "lower the outer optimizer's learning rate or the ES std")
    return LearnerState(meta_params, outer_state, state.outer_step + 1), verdict


def all_finite(tree: PyTree) -> bool:
    """One device-to-host transfer for the whole tree."""
    leaves = jax.tree.leaves(tree)
    return bool(jax.device_get(jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])))) if leaves else True


# ----------------------------------------------------------------------------------- self-training
def self_optimizer(rule: UpdateRule, *, warmup: optax.GradientTransformation | None = None, warmup_steps: int = 0,
                   time_scale: float = 1.0) -> optax.GradientTransformation:
    """The learned optimizer as its own outer optimizer (Metz et al. 2020, "... and using them to
    train themselves"): each outer step updates the meta-parameters ``theta`` with the rule they
    define, ``updates, s = rule.update(theta, s, g, theta, time_scale)``.

    An untrained rule is a poor optimizer of anything, itself included: for the first
    ``warmup_steps`` outer steps ``warmup`` (default ``optax.adam(3e-3)``) makes the updates instead
    (the rule's state, e.g. its momenta, still follows the gradients, so it takes over warm).
    Pass it as ``outer_optimizer`` to ``meta_train`` or ``MetaTraining`` (``"self"`` there is
    ``self_optimizer(rule)``: no warm-up).
    """
    warmup_steps = integer(warmup_steps, "warmup_steps", 0)
    time_scale = positive_float(time_scale, "time_scale")
    if uses_loss_and_num_steps(rule):
        raise ValueError(f"rule: {type(rule).__name__} reads the loss and the run's length, which self-training "
                         "(an outer step sees only the meta-gradient) does not have")
    if warmup is None and warmup_steps:
        warmup = optax.adam(3e-3)
    if warmup is not None and not isinstance(warmup, optax.GradientTransformation):
        raise TypeError(f"warmup must be an optax GradientTransformation or None, got {type(warmup).__name__}")

    def init(params: PyTree) -> PyTree:
        return {"rule": rule.init_state(params), "warmup": warmup.init(params) if warmup is not None else (),
                "count": jnp.zeros((), jnp.int32)}

    def update(grads: PyTree, state: PyTree, params: PyTree | None = None) -> tuple[PyTree, PyTree]:
        if params is None:
            raise ValueError("params: self-training reads the meta-parameters; call update(grads, state, params)")
        updates, rule_state = rule.update(params, state["rule"], grads, params, time_scale)
        warm_state = state["warmup"]
        if warmup is not None:
            warm_updates, warm_state = warmup.update(grads, warm_state, params)
            in_warmup = state["count"] < warmup_steps
            updates = jax.tree.map(lambda w, u: jnp.where(in_warmup, w, u), warm_updates, updates)
        return updates, {"rule": rule_state, "warmup": warm_state, "count": state["count"] + 1}

    return optax.GradientTransformation(init, update)


def outer_optimizer_of(value: Any, rule: UpdateRule, learning_rate: float = 3e-3) -> optax.GradientTransformation:
    """``outer_optimizer`` as an optax transformation: ``None`` is ``optax.adam(learning_rate)``,
    ``"self"`` is :func:`self_optimizer` of ``rule``; TypeError/ValueError naming it otherwise."""
    if value is None:
        return optax.adam(learning_rate)
    if isinstance(value, str):
        choice(value, "outer_optimizer", ("self",))
        return self_optimizer(rule)
    if not isinstance(value, optax.GradientTransformation):
        raise TypeError(f"outer_optimizer must be an optax GradientTransformation, 'self' or None, "
                        f"got {type(value).__name__}")
    return value
