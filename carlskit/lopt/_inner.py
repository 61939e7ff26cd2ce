"""Inner training: pure unrolls of a task under an update rule, single and vmapped over tasks.

Randomness is carried by one ``task_key`` per task instance: the initial parameters come from
``fold_in(task_key, 0)`` and the minibatch of inner step ``t`` from ``fold_in(fold_in(task_key, 1), t)``.
Two unrolls with the same ``task_key`` therefore start from the same point and see the same data
(the shared randomness of antithetic pairs, Metz et al. 2020 Sec. 3.2).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from carlskit._checks import positive_float
from carlskit.lopt._protocols import Task, UpdateRule, call_update

PyTree = Any


class InnerState(NamedTuple):
    """State of one inner training run: parameters, optimizer state, inner step index."""

    params: PyTree
    opt_state: PyTree
    step: jax.Array


def init_inner_state(rule: UpdateRule, task: Task, task_key: jax.Array, task_params: PyTree) -> InnerState:
    """Fresh parameters ``task.init(fold_in(task_key, 0))`` and optimizer state, step 0."""
    params = task.init(jax.random.fold_in(task_key, 0), task_params)
    return InnerState(params, rule.init_state(params), jnp.zeros((), jnp.int32))


def inner_step(rule: UpdateRule, task: Task, meta_params: PyTree, state: InnerState, batch: PyTree,
               task_params: PyTree, time_scale: float = 1.0,
               num_steps: int | jax.Array | None = None) -> tuple[InnerState, jax.Array]:
    """One inner training step, the only one: training (:func:`unroll`, hence every estimator, ES
    worker and ``meta_train``) and evaluation (:func:`carlskit.lopt.evaluation_curves`) both call it.

    ``l, g = value_and_grad(loss)(p, batch)``; ``updates, s = rule.update(theta, s, g, p, time_scale)``
    (through :func:`carlskit.lopt._protocols.call_update`: a rule that reads them also gets
    ``loss=l`` and ``num_steps``, the length of the whole run); ``p <- p + updates``; the step
    counter advances. Returns the new state and ``l``.
    """
    loss, grads = jax.value_and_grad(task.loss)(state.params, batch, task_params)
    updates, opt_state = call_update(rule, meta_params, state.opt_state, grads, state.params, time_scale,
                                     loss=loss, num_steps=num_steps)
    params = jax.tree.map(lambda p, u: p + u, state.params, updates)
    return InnerState(params, opt_state, state.step + 1), loss


# Minibatches of up to this many bytes per unroll are drawn before the inner loop, in one batched
# random draw and gather, instead of one small draw per inner step inside it (a 50-step digits
# unroll at batch 128 is 1.6 MiB).
_PREFETCH_BYTES = 4 << 20


def _prefetch_length(task: Task, task_params: PyTree, num_steps: int) -> int:
    """Inner steps whose minibatches are drawn together: the largest divisor of ``num_steps`` whose
    minibatches fit in ``_PREFETCH_BYTES`` (a divisor, so the loop body is compiled once)."""
    shapes = jax.eval_shape(task.batch, jax.random.PRNGKey(0), task_params)
    batch_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    limit = max(1, _PREFETCH_BYTES // max(batch_bytes, 1))
    return max((d for d in range(1, min(num_steps, limit) + 1) if num_steps % d == 0), default=1)


def unroll(rule: UpdateRule, task: Task, meta_params: PyTree, state: InnerState, task_key: jax.Array,
           task_params: PyTree, num_steps: int, time_scale: float = 1.0,
           run_length: int | jax.Array | None = None) -> tuple[InnerState, jax.Array]:
    """Run ``num_steps`` inner steps; returns the final state and the minibatch loss of each step.

    ``run_length``: the length of the whole run these steps are part of, given to rules that read
    it (:func:`inner_step`); ``None``: ``num_steps`` (an unroll from the start to the end, as in
    :func:`train_task`). A truncated unroll (PES) passes its episode's length, a traced scalar.

    Step ``t``: ``l_t, g_t = value_and_grad(loss)(p_t, batch_t)``; ``p_{t+1} = p_t + update(g_t)``,
    ``batch_t = task.batch(fold_in(fold_in(task_key, 1), t))``. The minibatches of a chunk of steps
    (all of them for short unrolls) are drawn together before that chunk's ``lax.scan`` (same values
    as drawing them step by step).
    """
    data_key = jax.random.fold_in(task_key, 1)
    length_of_run = num_steps if run_length is None else run_length

    def run(carry: InnerState, length: int) -> tuple[InnerState, jax.Array]:
        steps = carry.step + jnp.arange(length, dtype=carry.step.dtype)
        batches = jax.vmap(lambda t: task.batch(jax.random.fold_in(data_key, t), task_params))(steps)

        def body(carry: InnerState, index: jax.Array):
            # ``index`` is the scan's own counter, never batched: under vmap the minibatch is a
            # plain slice of ``batches`` (scanning over ``batches`` itself would first transpose
            # them to put the step axis in front of the vmapped axis).
            batch = jax.tree.map(lambda b: jax.lax.dynamic_index_in_dim(b, index, keepdims=False), batches)
            return inner_step(rule, task, meta_params, carry, batch, task_params, time_scale, length_of_run)

        return jax.lax.scan(body, carry, jnp.arange(length))

    chunk = _prefetch_length(task, task_params, num_steps)
    if chunk == num_steps:
        return run(state, num_steps)
    state, losses = jax.lax.scan(lambda carry, _: run(carry, chunk), state, None, length=num_steps // chunk)
    return state, losses.reshape(-1)


AGGREGATIONS: tuple[str, ...] = ("mean", "last")


def check_aggregation(aggregation: str) -> None:
    """ValueError unless ``aggregation`` is one of ``AGGREGATIONS``."""
    if not isinstance(aggregation, str) or aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")


def aggregate_losses(losses: jax.Array, aggregation: str) -> jax.Array:
    """Outer loss of an unroll (last axis = steps): ``mean`` over steps or the ``last`` step's loss."""
    check_aggregation(aggregation)
    if aggregation == "mean":
        return jnp.mean(losses, axis=-1)
    return losses[..., -1]


def mean_log_loss_ratio(final_losses: jax.Array, reference_losses: jax.Array,
                        initial_losses: jax.Array | None = None, floor_fraction: float = 1e-3) -> jax.Array:
    """Issue 41's meta-loss: ``mean_i log(max(L_i, f l0_i) / max(R_i, f l0_i))`` over tasks ``i``.

    ``L_i``: a task's final loss under the learned rule, ``R_i`` its reference (tuned Adam's final
    loss, precomputed per meta-training task), ``l0_i`` its initial loss and ``f = floor_fraction``
    (issue 30's protocol: losses floored at ``1e-3`` of the initial one, so a task solved to zero
    by both counts as a tie; ``initial_losses=None``: no floor). 0 means "as good as tuned Adam" in
    geometric mean, negative better; the metric the held-out comparison reports
    (:func:`carlskit.lopt.geometric_mean_ratio` is ``exp`` of it). A NaN final loss (diverged) counts
    as ``+inf``. Pure ``jnp``: usable inside jitted estimators and ``vmap``.

    Shapes must match (ValueError naming the argument); losses are expected positive.
    """
    final_losses = jnp.asarray(final_losses, jnp.float32)
    reference_losses = jnp.asarray(reference_losses, jnp.float32)
    if final_losses.ndim != 1 or final_losses.shape[0] == 0:
        raise ValueError(f"final_losses must be a non-empty 1-D array (one loss per task), got shape "
                         f"{final_losses.shape}")
    if reference_losses.shape != final_losses.shape:
        raise ValueError(f"reference_losses: shape {reference_losses.shape}, final_losses {final_losses.shape}")
    final_losses = jnp.where(jnp.isnan(final_losses), jnp.inf, final_losses)
    if initial_losses is not None:
        initial_losses = jnp.asarray(initial_losses, jnp.float32)
        if initial_losses.shape != final_losses.shape:
            raise ValueError(f"initial_losses: shape {initial_losses.shape}, final_losses {final_losses.shape}")
        floor = positive_float(floor_fraction, "floor_fraction") * initial_losses
        final_losses, reference_losses = jnp.maximum(final_losses, floor), jnp.maximum(reference_losses, floor)
    return jnp.mean(jnp.log(final_losses) - jnp.log(reference_losses))


def train_task(rule: UpdateRule, task: Task, meta_params: PyTree, task_key: jax.Array, num_steps: int,
               time_scale: float = 1.0) -> jax.Array:
    """Losses ``[num_steps]`` of training one task instance from scratch (``task_params`` from the key)."""
    task_params = task.sample_task_params(jax.random.fold_in(task_key, 2))
    state = init_inner_state(rule, task, task_key, task_params)
    _, losses = unroll(rule, task, meta_params, state, task_key, task_params, num_steps, time_scale)
    return losses


@functools.partial(jax.jit, static_argnames=("rule", "task", "num_steps"))
def train_tasks_vectorized(rule: UpdateRule, task: Task, meta_params: PyTree, task_keys: jax.Array,
                           num_steps: int, time_scale: float = 1.0) -> jax.Array:
    """Losses ``[num_tasks, num_steps]``: ``train_task`` vmapped over ``task_keys`` in one program."""
    return jax.vmap(lambda k: train_task(rule, task, meta_params, k, num_steps, time_scale))(task_keys)


@functools.partial(jax.jit, static_argnames=("rule", "task", "num_steps"))
def _train_task_jit(rule, task, meta_params, task_key, num_steps, time_scale=1.0):
    return train_task(rule, task, meta_params, task_key, num_steps, time_scale)


def train_tasks_serial(rule: UpdateRule, task: Task, meta_params: PyTree, task_keys: jax.Array,
                       num_steps: int, time_scale: float = 1.0) -> jax.Array:
    """Same result as ``train_tasks_vectorized`` by a Python loop over tasks (reference/baseline)."""
    return jnp.stack([_train_task_jit(rule, task, meta_params, k, num_steps, time_scale) for k in task_keys])
