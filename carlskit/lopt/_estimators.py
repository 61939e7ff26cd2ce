"""Outer-gradient estimators: antithetic ES over full unrolls and truncated PES (pure functions).

Both are vmapped over task instances and over the two members of each antithetic pair. The
members of a pair share their task key, so they start from the same initialisation and see the same
minibatches; only the meta-parameter perturbation ``+/- std * eps`` differs (Metz et al. 2020,
Sec. 3.2). With ``eps ~ N(0, I)``:

    full ES:  g = 1/N sum_i (L(theta + std eps_i) - L(theta - std eps_i)) / (2 std) * eps_i
    PES:      g = 1/N sum_i (L_i^+ - L_i^-) / (2 std) * sum_{truncations since reset} eps_i
              (Vicol et al. 2021, Persistent Evolution Strategies)

Pairs whose loss is not finite are dropped (NaN guarding) and, in PES, restarted.

Entry points usable from any process (e.g. Dask workers): ``full_es_gradient(meta_params, key, task_keys, ...)``
and ``pes_gradient(meta_params, key, state, ...)`` with configuration as static keyword arguments,
or ``make_full_es_estimator`` / ``make_pes_estimator`` which bind the configuration and jit.

``make_pes_estimator`` and ``make_full_es_estimator`` split the task axis (the pairs) over the local
JAX devices: with 2 devices each runs half of the pairs, and the only communication is the final
sum over pairs (an all-reduce of the meta-gradient). On a CPU host,
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` (set before JAX starts) gives N host devices
whose programs run on separate threads.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from carlskit._checks import positive_float, positive_int
from carlskit.lopt._checks import check_meta_params, meta_params_template
from carlskit.lopt._inner import InnerState, aggregate_losses, check_aggregation, init_inner_state, unroll
from carlskit.lopt._protocols import Task, UpdateRule

PyTree = Any


def _sample_perturbations(key: jax.Array, meta_params: PyTree, num: int, mask: PyTree | None = None) -> PyTree:
    """``num`` standard normal draws per leaf; times ``mask``'s leaf (a 0/1 scalar) where given."""
    leaves, treedef = jax.tree.flatten(meta_params)
    keys = jax.random.split(key, len(leaves))
    eps = treedef.unflatten([jax.random.normal(k, (num, *jnp.shape(x)), jnp.float32) for k, x in zip(keys, leaves)])
    return eps if mask is None else jax.tree.map(lambda e, m: e * jnp.asarray(m, jnp.float32), eps, mask)


def _pair_params(meta_params: PyTree, eps: PyTree, std: float) -> PyTree:
    """Meta-parameters of one pair stacked on a new leading axis: ``[theta + std eps, theta - std eps]``."""
    return jax.tree.map(lambda t, e: jnp.stack([t + std * e, t - std * e]), meta_params, eps)


def antithetic_combine(pair_losses: jax.Array, directions: PyTree, std: float) -> tuple[PyTree, jax.Array]:
    """``g = 1/N_valid sum_i (L_i^+ - L_i^-) / (2 std) * d_i`` over pairs with finite losses.

    ``pair_losses``: ``[N, 2]`` (+, -); ``directions``: pytree with leading axis ``N``.
    Returns the gradient and the ``[N]`` boolean mask of valid pairs.
    """
    valid = jnp.all(jnp.isfinite(pair_losses), axis=1)
    diff = jnp.where(valid, pair_losses[:, 0] - pair_losses[:, 1], 0.0)
    weights = diff / (2.0 * std) / jnp.maximum(jnp.sum(valid), 1)
    grad = jax.tree.map(lambda d: jnp.tensordot(weights, d, axes=1), directions)
    return grad, valid


def _metrics(pair_losses: jax.Array, valid: jax.Array) -> dict[str, jax.Array]:
    """Mean loss over the valid pairs (NaN when no pair is valid: there is no loss to report) and
    the fraction of dropped pairs."""
    mean_loss = jnp.sum(jnp.where(valid[:, None], pair_losses, 0.0)) / jnp.maximum(2 * jnp.sum(valid), 1)
    mean_loss = jnp.where(jnp.any(valid), mean_loss, jnp.nan)
    return {"outer_loss": mean_loss, "nan_fraction": 1.0 - jnp.mean(valid.astype(jnp.float32))}


@functools.partial(jax.jit, static_argnames=("rule", "task", "num_steps", "std", "aggregation"))
def full_es_gradient(meta_params: PyTree, key: jax.Array, task_keys: jax.Array, *, rule: UpdateRule, task: Task,
                     num_steps: int, std: float = 0.01, aggregation: str = "mean",
                     time_scale: float = 1.0) -> tuple[PyTree, dict[str, jax.Array]]:
    """Antithetic ES through full unrolls of ``num_steps`` from initialisation.

    ``task_keys``: ``[N]`` keys, one per task instance (the task batch); pair ``i`` trains the
    instance of ``task_keys[i]`` with ``theta + std eps_i`` and ``theta - std eps_i``, ``eps`` drawn
    from ``key``. Returns ``(grad, metrics)``, ``metrics['pair_losses']`` of shape ``[N, 2]``.
    """
    num_tasks = task_keys.shape[0]
    eps = _sample_perturbations(key, meta_params, num_tasks)

    def member(theta, task_key, task_params):
        state = init_inner_state(rule, task, task_key, task_params)
        _, losses = unroll(rule, task, theta, state, task_key, task_params, num_steps, time_scale)
        return aggregate_losses(losses, aggregation)

    def pair(task_key, eps_i):
        task_params = task.sample_task_params(jax.random.fold_in(task_key, 2))
        thetas = _pair_params(meta_params, eps_i, std)
        # Both members get the same task_key: same init, same minibatches.
        return jax.vmap(member, in_axes=(0, None, None))(thetas, task_key, task_params)

    pair_losses = jax.vmap(pair)(task_keys, eps)
    grad, valid = antithetic_combine(pair_losses, eps, std)
    return grad, {**_metrics(pair_losses, valid), "pair_losses": pair_losses}


class PESState(NamedTuple):
    """Persistent state of PES: per task, the two members' inner states and accumulated noise."""

    inner: InnerState            # leaves with leading axes [num_tasks, 2]
    accumulated_eps: PyTree      # leaves with leading axis [num_tasks]
    task_keys: jax.Array         # [num_tasks] keys
    task_params: PyTree          # leading axis [num_tasks]
    episode_end: jax.Array       # [num_tasks] int32: inner step at which the task restarts


def _fresh_tasks(rule, task, meta_params, key, num_tasks):
    task_keys = jax.random.split(key, num_tasks)
    task_params = jax.vmap(lambda k: task.sample_task_params(jax.random.fold_in(k, 2)))(task_keys)

    def pair_state(task_key, tp):
        state = init_inner_state(rule, task, task_key, tp)
        return jax.tree.map(lambda x: jnp.stack([x, x]), state)

    inner = jax.vmap(pair_state)(task_keys, task_params)
    acc = jax.tree.map(lambda t: jnp.zeros((num_tasks, *jnp.shape(t)), jnp.float32), meta_params)
    return inner, acc, task_keys, task_params


def pes_init_state(meta_params: PyTree, key: jax.Array, *, rule: UpdateRule, task: Task, num_tasks: int,
                   horizon: int, truncation_length: int) -> PESState:
    """Fresh PES state; first episodes end at random multiples of the truncation (staggered tasks).

    Not jitted on purpose: it runs once per task structure, and compiling it would cost more.
    """
    num_tasks, horizon = positive_int(num_tasks, "num_tasks"), positive_int(horizon, "horizon")
    truncation_length = positive_int(truncation_length, "truncation_length")
    if horizon % truncation_length:
        raise ValueError(f"horizon ({horizon}) must be a multiple of truncation_length ({truncation_length})")
    fresh_key, stagger_key = jax.random.split(key)
    inner, acc, task_keys, task_params = _fresh_tasks(rule, task, meta_params, fresh_key, num_tasks)
    num_truncations = horizon // truncation_length
    episode_end = truncation_length * jax.random.randint(stagger_key, (num_tasks,), 1, num_truncations + 1)
    return PESState(inner, acc, task_keys, task_params, episode_end.astype(jnp.int32))


def _select(mask: jax.Array, on_true: PyTree, on_false: PyTree) -> PyTree:
    def pick(a, b):
        m = mask.reshape(mask.shape + (1,) * (a.ndim - mask.ndim))
        return jnp.where(m, a, b)
    return jax.tree.map(pick, on_true, on_false)


def sample_horizons(key: jax.Array, num_tasks: int, min_horizon: int, horizon: int,
                    truncation_length: int) -> jax.Array:
    """``[num_tasks]`` episode lengths, log-uniform over ``[min_horizon, horizon]`` and rounded up to
    a multiple of ``truncation_length`` (so an episode ends at a truncation boundary)."""
    log_length = jax.random.uniform(key, (num_tasks,), minval=math.log(min_horizon), maxval=math.log(horizon))
    length = jnp.ceil(jnp.exp(log_length) / truncation_length) * truncation_length
    return jnp.clip(length, truncation_length, horizon).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("rule", "task", "num_tasks", "horizon", "truncation_length",
                                             "std", "aggregation", "min_horizon"))
def pes_gradient(meta_params: PyTree, key: jax.Array, state: PESState, *, rule: UpdateRule, task: Task,
                 num_tasks: int, horizon: int, truncation_length: int, std: float = 0.01,
                 aggregation: str = "mean", time_scale: float = 1.0, min_horizon: int | None = None,
                 perturbation_mask: PyTree | None = None) -> tuple[PyTree, PESState, dict[str, jax.Array]]:
    """One PES outer step: restart finished tasks, unroll each pair ``truncation_length`` steps,
    return ``(grad, new_state, metrics)``.

    ``min_horizon``: a restarted task's episode lasts a length drawn log-uniform over
    ``[min_horizon, horizon]`` (:func:`sample_horizons`; Metz et al. 2020 and VeLO sample the
    unroll length per task, so the rule's time features see many run lengths); ``None``: always
    ``horizon``. The length is drawn at a restart, independent of the meta-parameters, so the
    estimate stays unbiased across truncations as PES's is.

    ``perturbation_mask``: a pytree like ``meta_params`` of 0/1 scalars (traced: changing it does not
    recompile); meta-parameters under a 0 are not perturbed, so their gradient is 0 and the others'
    estimate carries no noise from them (a meta-training phase that freezes part of the rule, as
    Celo's two phases; issue 41). ``None``: every meta-parameter is perturbed."""
    if horizon % truncation_length:
        raise ValueError(f"horizon ({horizon}) must be a multiple of truncation_length ({truncation_length})")
    reset_key, eps_key = jax.random.split(key)
    step = state.inner.step[:, 0]
    reset = step >= state.episode_end
    fresh_inner, fresh_acc, fresh_keys, fresh_params = _fresh_tasks(rule, task, meta_params, reset_key, num_tasks)
    inner = _select(reset, fresh_inner, state.inner)
    acc = _select(reset, fresh_acc, state.accumulated_eps)
    task_keys = _select(reset, fresh_keys, state.task_keys)
    task_params = _select(reset, fresh_params, state.task_params)
    new_end = horizon if min_horizon is None else sample_horizons(
        jax.random.fold_in(reset_key, 7), num_tasks, min_horizon, horizon, truncation_length)
    episode_end = jnp.where(reset, new_end, state.episode_end)

    eps = _sample_perturbations(eps_key, meta_params, num_tasks, perturbation_mask)
    acc = jax.tree.map(lambda a, e: a + e, acc, eps)

    def member(theta, inner_state, task_key, tp, length):
        # ``length``: the episode's whole length, for rules that read the fraction of training done.
        new_state, losses = unroll(rule, task, theta, inner_state, task_key, tp, truncation_length, time_scale,
                                   run_length=length)
        return new_state, aggregate_losses(losses, aggregation)

    def pair(inner_pair, task_key, tp, eps_i, length):
        thetas = _pair_params(meta_params, eps_i, std)
        return jax.vmap(member, in_axes=(0, 0, None, None, None))(thetas, inner_pair, task_key, tp, length)

    new_inner, pair_losses = jax.vmap(pair)(inner, task_keys, task_params, eps, episode_end)
    grad, valid = antithetic_combine(pair_losses, acc, std)
    # A diverged pair is restarted at the next call.
    episode_end = jnp.where(valid, episode_end, 0)
    new_state = PESState(new_inner, acc, task_keys, task_params, episode_end.astype(jnp.int32))
    return grad, new_state, {**_metrics(pair_losses, valid), "pair_losses": pair_losses}


def make_full_es_estimator(rule: UpdateRule, task: Task, *, num_tasks: int, num_steps: int, std: float = 0.01,
                           aggregation: str = "mean", devices: Sequence[jax.Device] | None = None
                           ) -> Callable[[PyTree, jax.Array], tuple[PyTree, dict]]:
    """Bind the configuration: returns the pure ``(meta_params, key) -> (grad, metrics)``.

    The pairs are split over ``task_mesh(num_tasks, devices)`` as in :func:`make_pes_estimator`
    (the task keys split along ``("tasks",)``, everything else replicated); the result equals the
    one-device estimator's up to float summation order. ``meta_params`` must match
    ``rule.init_meta_params`` (structure, shapes, floating dtypes; checked on every call, in Python).
    """
    num_tasks, num_steps = positive_int(num_tasks, "num_tasks"), positive_int(num_steps, "num_steps")
    std = positive_float(std, "std")
    check_aggregation(aggregation)
    meta_params_template(rule)  # the rule's meta-parameter shapes, traced once here
    gradient = functools.partial(full_es_gradient, rule=rule, task=task, num_steps=num_steps, std=std,
                                 aggregation=aggregation)
    mesh = task_mesh(num_tasks, devices)
    if mesh is not None:
        split, replicated = NamedSharding(mesh, PartitionSpec("tasks")), NamedSharding(mesh, PartitionSpec())
        sharded = jax.jit(gradient, in_shardings=(replicated, replicated, split),
                          out_shardings=(replicated, replicated))

    def estimator(meta_params: PyTree, key: jax.Array) -> tuple[PyTree, dict]:
        check_meta_params(rule, meta_params)
        task_key, eps_key = jax.random.split(key)
        task_keys = jax.random.split(task_key, num_tasks)
        if mesh is None:
            return gradient(meta_params, eps_key, task_keys)
        return sharded(_place(meta_params, replicated), _place(eps_key, replicated), _place(task_keys, split))

    return estimator


class PESEstimator(NamedTuple):
    """``init(meta_params, key) -> state`` and ``gradient(meta_params, key, state) -> (grad, state, metrics)``."""

    init: Callable[[PyTree, jax.Array], PESState]
    gradient: Callable[[PyTree, jax.Array, PESState], tuple[PyTree, PESState, dict]]


def task_mesh(num_tasks: int, devices: Sequence[jax.Device] | None = None) -> Mesh | None:
    """The 1-D mesh ``("tasks",)`` that the ``num_tasks`` pairs are split over, or ``None`` (one device).

    ``devices=None``: the first ``d`` of ``jax.local_devices()``, ``d`` the largest count that
    divides ``num_tasks`` (so every device gets ``num_tasks / d`` whole pairs); ``None`` when that
    is 1. An explicit sequence is used as given (distinct devices) and must divide ``num_tasks``.
    """
    num_tasks = positive_int(num_tasks, "num_tasks")
    if devices is None:
        local = jax.local_devices()
        count = max(d for d in range(1, len(local) + 1) if num_tasks % d == 0)
        if count == 1:
            return None
        devices = local[:count]
    devices = list(devices)
    if not devices or not all(isinstance(d, jax.Device) for d in devices):
        raise TypeError(f"devices must be a non-empty sequence of jax.Device, got {devices!r}")
    if len(set(devices)) != len(devices):
        raise ValueError(f"devices must be distinct, got {devices!r}")
    if num_tasks % len(devices):
        raise ValueError(f"num_tasks ({num_tasks}) must be a multiple of the number of devices ({len(devices)})")
    return Mesh(np.array(devices), ("tasks",))


def _place(tree: PyTree, sharding: NamedSharding) -> PyTree:
    """``tree`` with every leaf on ``sharding``; leaves already there are passed through untouched."""
    return jax.tree.map(lambda x: x if getattr(x, "sharding", None) == sharding else jax.device_put(x, sharding),
                        tree)


def make_pes_estimator(rule: UpdateRule, task: Task, *, num_tasks: int, horizon: int, truncation_length: int,
                       std: float = 0.01, aggregation: str = "mean",
                       devices: Sequence[jax.Device] | None = None, min_horizon: int | None = None) -> PESEstimator:
    """Bind the configuration of truncated PES; both returned functions are pure and jitted.

    ``min_horizon``: episode lengths log-uniform over ``[min_horizon, horizon]`` (see :func:`pes_gradient`).

    The pairs are split over ``task_mesh(num_tasks, devices)`` (by default all local devices that
    divide ``num_tasks``; pass ``devices=jax.local_devices()[:1]`` for one device): the PES state
    lives sharded along its task axis (``NamedSharding(mesh, P("tasks"))``), ``meta_params`` and
    ``key`` are replicated, and ``grad`` and ``metrics`` come back replicated over the devices.
    The result equals the one-device estimator's up to float summation order. ``meta_params`` must
    match ``rule.init_meta_params`` (structure, shapes, floating dtypes; checked on every call, in Python).
    """
    num_tasks, horizon = positive_int(num_tasks, "num_tasks"), positive_int(horizon, "horizon")
    truncation_length = positive_int(truncation_length, "truncation_length")
    if horizon % truncation_length:
        raise ValueError(f"horizon ({horizon}) must be a multiple of truncation_length ({truncation_length})")
    std = positive_float(std, "std")
    check_aggregation(aggregation)
    if min_horizon is not None:
        min_horizon = positive_int(min_horizon, "min_horizon")
        if min_horizon > horizon:
            raise ValueError(f"min_horizon ({min_horizon}) must be at most horizon ({horizon})")
    meta_params_template(rule)  # the rule's meta-parameter shapes, traced once here
    config = dict(rule=rule, task=task, num_tasks=num_tasks, horizon=horizon, truncation_length=truncation_length)
    unchecked_init = functools.partial(pes_init_state, **config)
    unchecked_gradient = functools.partial(pes_gradient, std=std, aggregation=aggregation, min_horizon=min_horizon,
                                           **config)

    def init(meta_params: PyTree, key: jax.Array) -> PESState:
        check_meta_params(rule, meta_params)
        return unchecked_init(meta_params, key)

    def gradient(meta_params: PyTree, key: jax.Array, state: PESState
                 ) -> tuple[PyTree, PESState, dict[str, jax.Array]]:
        check_meta_params(rule, meta_params)
        return unchecked_gradient(meta_params, key, state)

    mesh = task_mesh(num_tasks, devices)
    if mesh is None:
        return PESEstimator(init, gradient)
    split = NamedSharding(mesh, PartitionSpec("tasks"))  # every PESState leaf has the task axis first
    replicated = NamedSharding(mesh, PartitionSpec())
    sharded_gradient = jax.jit(unchecked_gradient, in_shardings=(replicated, replicated, split),
                               out_shardings=(replicated, split, replicated))

    def init_on_mesh(meta_params: PyTree, key: jax.Array) -> PESState:
        return _place(init(meta_params, key), split)

    def gradient_on_mesh(meta_params: PyTree, key: jax.Array, state: PESState
                         ) -> tuple[PyTree, PESState, dict[str, jax.Array]]:
        check_meta_params(rule, meta_params)
        return sharded_gradient(_place(meta_params, replicated), _place(key, replicated), _place(state, split))

    return PESEstimator(init_on_mesh, gradient_on_mesh)
