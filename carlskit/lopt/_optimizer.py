"""``LearnedOptimizer``: a thin object holding an update rule and meta-parameters.

It turns them into an optax transformation, saves/loads them without pickle, ships pretrained
meta-parameters, and runs a single-process meta-training loop over the pure estimators.
"""

from __future__ import annotations

import functools
import importlib.resources
import math
import os
import pathlib
import time
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from carlskit._checks import choice, integer, positive_float, positive_int
from carlskit._errors import CorruptFileError
from carlskit._history import History
from carlskit._notebook import LoopDisplay
from carlskit._transfers import steady_state
from carlskit.lopt._checks import check_meta_params, check_real_floating, check_same_layout
from carlskit.lopt._inner import train_task, train_tasks_vectorized
from carlskit.lopt._io import load_meta_params, meta_params_file, save_meta_params
from carlskit.lopt._outer import (
    Estimators,
    LearnerConfig,
    OuterStream,
    learner_apply,
    outer_optimizer_of,
    worker_estimate,
)
from carlskit.lopt._protocols import Task, TaskFamily, UpdateRule, call_update, uses_loss_and_num_steps
from carlskit.lopt._rule_config import rule_from_config, rule_to_config
from carlskit.lopt._rules import LearnableAdamRule, MLPUpdateRule
from carlskit.lopt._tasks import as_task_family

PyTree = Any
PRETRAINED_NAME = "pretrained_mlp_lopt"


class LearnedOptimizer:
    """Per-parameter learned optimizer (Metz et al. 2022, "VeLO/practical tradeoffs"; MLPLOpt).

    ``rule`` is a pure update rule (default ``MLPUpdateRule()``); ``meta_params`` its parameters
    (``init(key)`` makes random ones, ``pretrained()`` loads the shipped ones). ``train_horizon``
    is the inner-training length the meta-parameters were trained for (used by ``as_optax(num_steps=)``).
    """

    def __init__(self, rule: UpdateRule | None = None, meta_params: PyTree | None = None,
                 train_horizon: int | None = None, info: dict[str, Any] | None = None) -> None:
        self.rule = MLPUpdateRule() if rule is None else rule
        for name in ("init_meta_params", "init_state", "update"):
            if not callable(getattr(self.rule, name, None)):
                raise TypeError(f"rule must define {name}(); got {type(self.rule).__name__}")
        if meta_params is not None:
            self._check_meta_params(meta_params)
        if train_horizon is not None:
            train_horizon = positive_int(train_horizon, "train_horizon")
        if info is not None and not isinstance(info, Mapping):
            raise TypeError(f"info must be a dict or None, got {type(info).__name__}")
        self.meta_params = meta_params
        self.train_horizon = train_horizon
        self.info = dict(info or {})
        #: ``meta_train``'s records, one per outer step: ``step``, ``outer_loss``, ``nan_fraction``
        self.history = History()

    def __repr__(self) -> str:
        state = "untrained" if self.meta_params is None else f"{self.num_meta_params} meta-params"
        return f"{type(self).__name__}({self.rule!r}, {state}, train_horizon={self.train_horizon})"

    # ------------------------------------------------------------------ meta-parameters
    def init(self, key: jax.Array) -> PyTree:
        """Fresh meta-parameters ``rule.init_meta_params(key)`` (does not store them)."""
        if not _is_prng_key(key):
            raise TypeError(f"key must be a JAX random key such as jax.random.PRNGKey(0) or jax.random.key(0), "
                            f"got {key!r}")
        return self.rule.init_meta_params(key)

    @property
    def num_meta_params(self) -> int:
        return int(sum(np.size(x) for x in jax.tree.leaves(self.meta_params)))

    def _check_meta_params(self, meta_params: PyTree) -> None:
        """Structure and shapes of ``rule.init_meta_params``, real floating dtypes, finite values."""
        check_meta_params(self.rule, meta_params, finite=True)

    def _resolve(self, meta_params: PyTree | None) -> PyTree:
        if meta_params is None:
            if self.meta_params is None:
                raise ValueError("meta_params: none given and this optimizer holds none "
                                 "(use init(key), pretrained() or meta_train())")
            return self.meta_params
        self._check_meta_params(meta_params)
        return meta_params

    # ------------------------------------------------------------------ optax adapter
    def as_optax(self, meta_params: PyTree | None = None,
                 num_steps: int | None = None) -> optax.GradientTransformationExtraArgs:
        """An optax transformation applying the learned rule; ``update`` needs ``params``.

        ``num_steps``: the length of the run it will be used for; the time features then see
        ``t * train_horizon / num_steps`` so a schedule learned for ``train_horizon`` stretches to
        the new length. Extra arguments such as ``loss=`` are accepted and ignored, except optax's
        ``value=`` (the loss at ``params``) for a rule that reads the loss (e.g.
        :class:`NominalAdamRule`): it needs ``num_steps`` here and ``tx.update(grads, state, params,
        value=loss)`` (ValueError naming the missing one).

        Params must have real floating dtypes (TypeError naming the leaf, e.g. ``params['b']``);
        grads and state must match params leaf by leaf (ValueError naming the leaf and both shapes).
        These checks are Python on static dtypes and shapes: under ``jit`` they run once, at trace time.
        """
        theta = self._resolve(meta_params)
        if num_steps is not None:
            num_steps = positive_int(num_steps, "num_steps")
        time_scale = 1.0 if num_steps is None or self.train_horizon is None else self.train_horizon / num_steps
        rule = self.rule
        if uses_loss_and_num_steps(rule) and num_steps is None:
            raise ValueError(f"num_steps: {type(rule).__name__} schedules its step size over the run; "
                             "give the run's length, as_optax(num_steps=...)")

        # Checks are Python on dtypes and static shapes: under jit they run once, at trace time.
        def init_fn(params: PyTree) -> PyTree:
            check_real_floating(params, "params")
            return rule.init_state(params)

        def update_fn(updates: PyTree, state: PyTree, params: PyTree | None = None, **extra_args: Any):
            if params is None:
                raise ValueError("params: the learned optimizer reads parameter values; "
                                 "call tx.update(grads, state, params)")
            check_real_floating(params, "params")
            check_same_layout(params, "params", updates, "grads")
            check_real_floating(updates, "grads")
            value = extra_args.get("value")
            if uses_loss_and_num_steps(rule) and value is None:
                raise ValueError(f"value: {type(rule).__name__} reads the loss; call "
                                 "tx.update(grads, state, params, value=loss)")
            return call_update(rule, theta, state, updates, params, time_scale, loss=value, num_steps=num_steps)

        return optax.GradientTransformationExtraArgs(init_fn, update_fn)

    # ------------------------------------------------------------------ persistence
    def config(self) -> dict[str, Any]:
        return {"rule": rule_to_config(self.rule), "train_horizon": self.train_horizon, "info": self.info}

    def save(self, meta_params: PyTree | None, path: str | os.PathLike) -> pathlib.Path:
        """Write one ``.npz`` (arrays + JSON config, no pickle) atomically; returns the file written.

        The file is ``path`` if it ends in ``.npz``, else ``path + ".npz"``. ``None`` saves the held
        meta-parameters. Everything is checked before writing: on error the old file is untouched.
        """
        return save_meta_params(path, self._resolve(meta_params), self.config())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "LearnedOptimizer":
        """A ``LearnedOptimizer`` with the rule, meta-parameters and horizon stored at ``path`` (``.npz`` optional).

        Raises ``FileNotFoundError`` for a missing file, :class:`carlskit.CorruptFileError` (a
        ``ValueError``) naming the file for a damaged one, whatever the damage.
        """
        file = meta_params_file(path)
        meta_params, config = load_meta_params(file)
        unknown = sorted(set(config) - {"rule", "train_horizon", "info"})
        if "rule" not in config or unknown:
            raise CorruptFileError(file, f"config must hold 'rule', 'train_horizon', 'info'; got keys {sorted(config)}")
        train_horizon, info = config.get("train_horizon"), config.get("info", {})
        if train_horizon is not None and (type(train_horizon) is not int or train_horizon < 1):
            raise CorruptFileError(file, f"train_horizon must be a positive int or null, got {train_horizon!r}")
        if not isinstance(info, dict) or not isinstance(config["rule"], dict):
            raise CorruptFileError(file, "'rule' and 'info' must be JSON objects")
        try:
            return LearnedOptimizer(rule_from_config(config["rule"]), meta_params, train_horizon, info)
        except (TypeError, ValueError, ArithmeticError) as err:  # unknown rule field, leaves not fitting the rule
            raise CorruptFileError(file, f"stored rule and meta-parameters do not fit ({err})") from err

    @classmethod
    def pretrained(cls) -> "LearnedOptimizer":
        """The learned optimizer that ships with carlskit: a :class:`HierarchicalRule` meta-trained on
        :func:`meta_training_family` by the ``MetaTraining`` cluster. Its ``info`` holds the command
        that made it, the compute, every checkpoint's evaluation and the comparison with tuned Adam
        on :func:`held_out_problems`. Reproduce with ``python -m carlskit.lopt.train_pretrained``.
        """
        resource = importlib.resources.files("carlskit.lopt") / f"{PRETRAINED_NAME}.npz"
        with importlib.resources.as_file(resource) as file:
            return cls.load(file)

    # ------------------------------------------------------------------ evaluation
    def train_curves(self, task: Task, num_steps: int = 200, num_tasks: int = 8, seed: int = 0,
                     meta_params: PyTree | None = None) -> np.ndarray:
        """Inner-training losses ``[num_tasks, num_steps]`` of ``task`` instances, all vmapped."""
        theta = self._resolve(meta_params)
        num_steps, num_tasks = positive_int(num_steps, "num_steps"), positive_int(num_tasks, "num_tasks")
        time_scale = 1.0 if self.train_horizon is None else self.train_horizon / num_steps
        keys = jax.random.split(jax.random.PRNGKey(seed), num_tasks)
        return np.asarray(train_tasks_vectorized(self.rule, task, theta, keys, num_steps, time_scale))

    # ------------------------------------------------------------------ meta-training
    def meta_train(self, task_family: TaskFamily | Task, num_outer_steps: int = 100, *,
                   estimator: str = "pes", num_tasks: int = 8, horizon: int = 200,
                   truncation_length: int = 50, std: float = 0.01, meta_learning_rate: float = 3e-3,
                   aggregation: str = "mean", seed: int = 0, meta_params: PyTree | None = None,
                   progress: bool = True, live_plot: bool | None = None, plot_every: int = 10,
                   time_budget_s: float | None = None,
                   callback: Callable[[int, dict[str, float]], None] | None = None,
                   outer_optimizer: optax.GradientTransformation | str | None = None) -> "LearnedOptimizer":
        """Meta-train with ``estimator`` in ``{'pes', 'es'}`` and Adam on the meta-parameters
        (``outer_optimizer``: another optax transformation, or ``"self"`` for self-training, see
        :func:`carlskit.lopt.self_optimizer`; ``meta_learning_rate`` is Adam's).

        Each outer step samples a task structure from ``task_family`` and runs ``num_tasks``
        antithetic pairs of it vmapped. PES keeps one persistent state per task structure (unrolls
        of ``truncation_length`` within episodes of ``horizon`` steps); ES unrolls ``horizon`` steps.
        Starts from ``meta_params``, else the held ones, else ``init(PRNGKey(seed))``. Shows a
        tqdm bar and, in a notebook (``live_plot=None``), a live outer-loss curve. Returns a new
        ``LearnedOptimizer`` carrying the result and its ``history`` (a :class:`carlskit.History`:
        one record per outer step, ``step`` counting from 1, ``outer_loss``, ``nan_fraction``).

        This is the meta-training cluster in one process: each outer step is the ES worker's
        :func:`~carlskit.lopt._outer.worker_estimate` then the learner's
        :func:`~carlskit.lopt._outer.learner_apply`, so ``MetaTraining`` with one ES worker,
        ``max_staleness=0`` and one gradient per update reproduces ``estimator='es'`` for the same
        seed. An outer step in which every pair diverged records ``outer_loss`` NaN and leaves the
        meta-parameters and Adam's state untouched; meta-parameters that become non-finite after an
        update raise ``FloatingPointError``.
        """
        num_outer_steps = positive_int(num_outer_steps, "num_outer_steps")
        estimators = Estimators(self.rule, choice(estimator, "estimator", ("pes", "es")), num_tasks=num_tasks,
                                num_steps=positive_int(horizon, "horizon"), std=std, aggregation=aggregation,
                                truncation_length=positive_int(truncation_length, "truncation_length"))
        plot_every = positive_int(plot_every, "plot_every")
        meta_learning_rate = positive_float(meta_learning_rate, "meta_learning_rate")
        if time_budget_s is not None:
            time_budget_s = positive_float(time_budget_s, "time_budget_s")
        family = as_task_family(task_family)
        key = jax.random.PRNGKey(seed)
        if meta_params is None and self.meta_params is None:
            key, init_key = jax.random.split(key)
            meta_params = self.init(init_key)
        config = LearnerConfig.of(self.rule, outer_optimizer_of(outer_optimizer, self.rule, meta_learning_rate))
        state, stream = config.init(self._resolve(meta_params)), OuterStream(family, key, seed)
        history = History()
        display = LoopDisplay(history, num_outer_steps, f"meta-train ({estimator})", progress=progress,
                              live=live_plot if live_plot is not None else (None if progress else False),
                              curves=("outer_loss",), title=f"{estimator.upper()} meta-training, {num_tasks} tasks",
                              postfix="outer_loss", plot_every=plot_every, plot_seconds=0.5)
        started = time.monotonic()
        warm_tasks = set()  # task structures whose estimator is compiled (and, for PES, its state made)
        for outer_step in range(num_outer_steps):
            task, step_key, init_key = stream.next()
            with steady_state(warm=task in warm_tasks):
                record = worker_estimate(estimators, state.meta_params, task, step_key, state.outer_step,
                                         init_key=init_key)
                try:
                    state, _ = learner_apply(state, [record], config)
                except FloatingPointError as error:
                    raise FloatingPointError(f"meta_train: {error} (outer step {outer_step}, "
                                             f"meta_learning_rate={meta_learning_rate})") from None
            warm_tasks.add(task)
            history.append({"step": outer_step + 1, "outer_loss": record["outer_loss"],
                            "nan_fraction": record["nan_fraction"]})
            display.record(history[-1])
            if callback is not None:
                callback(outer_step, {"outer_loss": record["outer_loss"], "nan_fraction": record["nan_fraction"]})
            if time_budget_s is not None and time.monotonic() - started > time_budget_s:
                break
        display.close()
        display.show_final_frames()
        trained = type(self).__new__(type(self))
        LearnedOptimizer.__init__(trained, self.rule, state.meta_params, horizon, self.info)
        trained.history = history
        return trained


def _is_prng_key(key: Any) -> bool:
    """A typed key (``jax.random.key``) or a raw ``uint32[2]`` one (``jax.random.PRNGKey``)."""
    dtype = getattr(key, "dtype", None)
    if dtype is None:
        return False
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return True
    return dtype == np.uint32 and tuple(np.shape(key)) == (2,)


class LearnableAdam(LearnedOptimizer):
    """Adam with meta-learned ``lr, beta1, beta2, eps`` (the baseline of Metz et al.); same API."""

    def __init__(self, meta_params: PyTree | None = None, train_horizon: int | None = None,
                 initial_learning_rate: float = 1e-3, info: dict[str, Any] | None = None) -> None:
        rule = LearnableAdamRule(initial_learning_rate)
        super().__init__(rule, rule.init_meta_params() if meta_params is None else meta_params,
                         train_horizon, info)


#: The learning rates tried when tuning the Adam baseline per problem (the best one is compared).
ADAM_LEARNING_RATES = (3e-4, 1e-3, 3e-3, 1e-2, 3e-2)
#: The evaluation protocol's grid (issue 30): 1e-4 .. 1e-1 in half decades, widened at an edge if needed.
WIDE_ADAM_LEARNING_RATES = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)


def tuned_learning_rate(make_optimizer: Callable[[Any], optax.GradientTransformation], task: Task,
                        learning_rates: Sequence[float], num_steps: int = 200, num_tasks: int = 4,
                        seed: int = 1000) -> tuple[float, np.ndarray]:
    """Grid-search the learning rate of the optax optimizer ``make_optimizer(lr)`` on ``task`` by the
    mean training loss of the last 10 steps (a diverged learning rate scores +inf).

    All learning rates and ``num_tasks`` instances (keys from ``seed``, so tune on other instances
    than you evaluate on) train in one vmapped program; each curve equals
    ``optax_train_curves(make_optimizer(lr), task, num_steps, num_tasks, seed)``.
    Returns ``(best_lr, curves[lr, task, step])``.
    """
    if not callable(make_optimizer):
        raise TypeError(f"make_optimizer must be a callable lr -> optax.GradientTransformation, "
                        f"got {type(make_optimizer).__name__}")
    rates = _learning_rates(learning_rates)
    num_steps = positive_int(num_steps, "num_steps")
    keys = jax.random.split(jax.random.PRNGKey(integer(seed, "seed", 0)), positive_int(num_tasks, "num_tasks"))
    curves = _grid_curves(make_optimizer, task, rates, keys, num_steps)
    return _best_rate(rates, curves), curves


def _learning_rates(learning_rates: Sequence[float]) -> np.ndarray:
    rates = np.asarray(learning_rates, np.float64)
    if rates.ndim != 1 or rates.size == 0 or not np.all(np.isfinite(rates)) or np.any(rates <= 0):
        raise ValueError(f"learning_rates must be a non-empty sequence of positive finite numbers, "
                         f"got {learning_rates!r}")
    return rates


def _grid_curves(make_optimizer: Callable[[Any], optax.GradientTransformation], task: Task, rates: np.ndarray,
                 keys: jax.Array, num_steps: int) -> np.ndarray:
    """Curves ``[lr, key, step]`` of ``make_optimizer(lr)`` for every rate and task key, one program."""
    return np.asarray(_grid_program(make_optimizer, task, num_steps)(jnp.asarray(rates, jnp.float32), keys))


@functools.lru_cache(maxsize=64)
def _grid_program(make_optimizer: Callable[[Any], optax.GradientTransformation], task: Task, num_steps: int):
    """The jitted grid program of one (optimizer, task, length), kept: a grid widened one rate at a
    time, or rerun on other keys, compiles once per shape instead of once per call."""
    def curves_for(lr, keys):
        rule = _OptaxRule(make_optimizer(lr))
        return jax.vmap(lambda k: train_task(rule, task, {}, k, num_steps))(keys)

    return jax.jit(jax.vmap(curves_for, in_axes=(0, None)))


def _best_rate(rates: np.ndarray, curves: np.ndarray) -> float:
    """The rate whose curves ``[lr, key, step]`` end lowest (last 10 steps; diverged = +inf)."""
    finals = np.nan_to_num(curves[:, :, -10:].mean(axis=(1, 2)), nan=np.inf)
    return float(rates[int(np.argmin(finals))])


def tuned_adam(task: Task, num_steps: int = 200, num_tasks: int = 4, seed: int = 1000,
               learning_rates: Sequence[float] = ADAM_LEARNING_RATES) -> tuple[float, np.ndarray]:
    """Adam at its best learning rate on ``task``: the baseline a learned optimizer has to beat
    without tuning (the grid 3e-4 ... 3e-2 by default). See :func:`tuned_learning_rate`."""
    return tuned_learning_rate(optax.adam, task, learning_rates, num_steps, num_tasks, seed)


def tuned_sgd_learning_rate(task: Task, num_steps: int = 200, num_tasks: int = 4, seed: int = 1000,
                            learning_rates: tuple[float, ...] = tuple(10.0 ** np.arange(-3.0, 1.01, 0.25)),
                            ) -> tuple[float, np.ndarray]:
    """Plain SGD ``p <- p - lr g`` at its best learning rate on ``task``: :func:`tuned_learning_rate`
    with ``optax.sgd``."""
    return tuned_learning_rate(optax.sgd, task, learning_rates, num_steps, num_tasks, seed)


def final_loss(curves: np.ndarray) -> float:
    """The "final training loss" of curves ``[instances, steps]``: the mean over instances of the
    last 10 steps' minibatch losses (``inf`` if any is not finite: a diverged run)."""
    value = float(np.mean(np.asarray(curves)[..., -10:]))
    return value if np.isfinite(value) else float("inf")


def compare_to_tuned_adam(lopt: "LearnedOptimizer", problems: Mapping[str, Task], num_steps: int = 200,
                          num_instances: int = 8, seed: int = 0, tune_instances: int = 4, tune_seed: int = 1000,
                          learning_rates: Sequence[float] = ADAM_LEARNING_RATES,
                          others: Mapping[str, "LearnedOptimizer"] | None = None, *,
                          floor_fraction: float | None = None, widen: int = 0) -> list[dict[str, Any]]:
    """One row per problem: ``lopt``'s :func:`final_loss` after ``num_steps`` steps against Adam at
    the learning rate :func:`tuned_adam` picked on other instances (``tune_seed``), both on the same
    ``num_instances`` instances (``seed``): ``{"problem", "learned", "tuned_adam", "adam_learning_rate",
    "ratio", "initial_loss", "rate_inside_grid"}`` (``ratio`` = learned / tuned Adam; below 1 the
    learned optimizer wins), plus one column per entry of ``others`` (e.g. the untrained optimizer),
    on the same instances.

    ``floor_fraction``: both final losses are floored at ``floor_fraction * initial_loss`` (the mean
    first-step loss) before the ratio, so two runs that solved the problem tie at 1.0 instead of
    comparing round-off. ``widen``: while the best rate sits at an edge of the grid, add up to this
    many rates beyond that edge (half-decade steps, x/÷ sqrt(10)); ``rate_inside_grid`` says whether
    the best rate ended strictly inside the grid tried (a baseline tuned at its grid's edge is not tuned).
    """
    others = {} if others is None else others
    for name, value in (("lopt", lopt), *((f"others[{k!r}]", v) for k, v in others.items())):
        if not isinstance(value, LearnedOptimizer):
            raise TypeError(f"{name} must be a LearnedOptimizer, got {type(value).__name__}")
    if not isinstance(problems, Mapping) or not problems:
        raise TypeError(f"problems must be a non-empty mapping name -> Task, got {type(problems).__name__}")
    for name, task in problems.items():
        if not isinstance(task, Task):
            raise TypeError(f"problems[{name!r}] must be a Task, got {type(task).__name__}")
    rates, num_steps = _learning_rates(learning_rates), positive_int(num_steps, "num_steps")
    tune_keys = jax.random.split(jax.random.PRNGKey(integer(tune_seed, "tune_seed", 0)),
                                 positive_int(tune_instances, "tune_instances"))
    eval_keys = jax.random.split(jax.random.PRNGKey(integer(seed, "seed", 0)),
                                 positive_int(num_instances, "num_instances"))
    if floor_fraction is not None:
        floor_fraction = positive_float(floor_fraction, "floor_fraction")
    widen = integer(widen, "widen", 0)
    keys = jnp.concatenate([tune_keys, eval_keys])
    rows = []
    for name, task in problems.items():
        # One program trains Adam at every rate on the tuning and the evaluation instances: the
        # rate is picked on the first (as tuned_adam does), its curves on the second are the baseline
        # (equal to optax_train_curves(optax.adam(lr), task, num_steps, num_instances, seed)).
        grid = np.sort(rates)
        curves = _grid_curves(optax.adam, task, grid, keys, num_steps)
        for _ in range(widen):
            lr = _best_rate(grid, curves[:, :len(tune_keys)])
            if grid.size > 1 and grid[0] < lr < grid[-1]:
                break
            extra = np.asarray([lr / math.sqrt(10.0) if lr == grid[0] else lr * math.sqrt(10.0)])
            extra_curves = _grid_curves(optax.adam, task, extra, keys, num_steps)
            grid, curves = np.concatenate([grid, extra]), np.concatenate([curves, extra_curves])
            order = np.argsort(grid)
            grid, curves = grid[order], curves[order]
        lr = _best_rate(grid, curves[:, :len(tune_keys)])
        adam_curves = curves[int(np.flatnonzero(grid == lr)[0]), len(tune_keys):]
        initial = float(np.mean(adam_curves[:, 0]))  # every optimizer starts from the same instances
        floor = 0.0 if floor_fraction is None else floor_fraction * initial
        adam = final_loss(adam_curves)
        learned = final_loss(lopt.train_curves(task, num_steps, num_instances, seed))
        low, high = max(learned, floor), max(adam, floor)
        rows.append({"problem": name, "learned": learned, "tuned_adam": adam, "adam_learning_rate": lr,
                     "ratio": low / high if high > 0 else float("nan"), "initial_loss": initial,
                     "rate_inside_grid": bool(grid.size > 2 and grid[0] < lr < grid[-1]),
                     **{key: final_loss(other.train_curves(task, num_steps, num_instances, seed))
                        for key, other in others.items()}})
    return rows


def compare_at_horizons(lopt: "LearnedOptimizer", problems: Mapping[str, Task], horizon: int,
                        multiples: Sequence[int] = (1, 5), *, num_instances: int = 8, seed: int = 0,
                        learning_rates: Sequence[float] = WIDE_ADAM_LEARNING_RATES, widen: int = 3,
                        floor_fraction: float = 1e-3) -> list[dict[str, Any]]:
    """The evaluation protocol of issue 30: :func:`compare_to_tuned_adam` at ``horizon * m`` inner
    steps for each ``m`` in ``multiples`` (default the meta-training horizon and 5x it), Adam tuned
    over ``learning_rates`` (1e-4 .. 1e-1, widened while its best rate is at an edge), losses floored
    at ``floor_fraction`` of the initial loss. The learned optimizer runs as ``train_curves`` does:
    its time features stretched to the run's length. Rows carry ``horizon`` and ``multiple``;
    :func:`summarize_comparison` makes the verdict."""
    horizon = positive_int(horizon, "horizon")
    multiples = [positive_int(m, f"multiples[{i}]") for i, m in enumerate(multiples)]
    if not multiples:
        raise ValueError("multiples must name at least one horizon multiple, got ()")
    rows = []
    for multiple in multiples:
        for row in compare_to_tuned_adam(lopt, problems, horizon * multiple, num_instances, seed,
                                         learning_rates=learning_rates, floor_fraction=floor_fraction, widen=widen):
            rows.append({**row, "horizon": horizon * multiple, "multiple": multiple})
    return rows


def summarize_comparison(rows: Sequence[Mapping[str, Any]], *, worst_allowed: float = 1.25) -> dict[str, Any]:
    """The verdict over ``rows`` (of :func:`compare_to_tuned_adam` / :func:`compare_at_horizons`):
    ``cases``, ``at_or_below_adam`` (fraction with ratio <= 1), ``worse_than_allowed`` (count with
    ratio > ``worst_allowed``), ``worst_ratio`` and ``worst_case``, ``geomean`` (of the ratios),
    ``rates_inside_grid`` (fraction of cases whose Adam rate was strictly inside its grid)."""
    if not rows:
        raise ValueError("rows must hold at least one comparison row, got none")
    ratios = np.asarray([row["ratio"] for row in rows], np.float64)
    worst = int(np.nanargmax(np.where(np.isfinite(ratios), ratios, np.inf)))
    name = rows[worst]["problem"] + (f" @{rows[worst]['horizon']}" if "horizon" in rows[worst] else "")
    return {"cases": len(rows), "at_or_below_adam": float(np.mean(ratios <= 1.0)),
            "worse_than_allowed": int(np.sum(~(ratios <= worst_allowed))), "worst_ratio": float(ratios[worst]),
            "worst_case": name, "geomean": geometric_mean_ratio(rows),
            "rates_inside_grid": float(np.mean([bool(row.get("rate_inside_grid", True)) for row in rows]))}


def geometric_mean_ratio(rows: Sequence[Mapping[str, Any]]) -> float:
    """Geometric mean of the rows' ``ratio`` (``inf`` when any run diverged)."""
    ratios = np.asarray([row["ratio"] for row in rows], np.float64)
    return float(np.exp(np.mean(np.log(ratios)))) if np.all(np.isfinite(ratios)) else float("inf")


def optax_train_curves(transformation: optax.GradientTransformation, task: Task, num_steps: int = 200,
                       num_tasks: int = 8, seed: int = 0) -> np.ndarray:
    """Losses ``[num_tasks, num_steps]`` of training ``task`` instances with an optax optimizer
    (same task keys and minibatches as ``LearnedOptimizer.train_curves`` for the same ``seed``)."""
    rule = _OptaxRule(transformation)
    keys = jax.random.split(jax.random.PRNGKey(seed), num_tasks)
    return np.asarray(jax.jit(jax.vmap(lambda k: train_task(rule, task, {}, k, num_steps)))(keys))


class _OptaxRule(UpdateRule):
    """Adapts any optax transformation to the update-rule protocol (no meta-parameters)."""

    def __init__(self, transformation: optax.GradientTransformation) -> None:
        self.transformation = transformation

    def init_meta_params(self, key=None):
        return {}

    def init_state(self, params):
        return self.transformation.init(params)

    def update(self, meta_params, state, grads, params, time_scale=1.0):
        return self.transformation.update(grads, state, params)
