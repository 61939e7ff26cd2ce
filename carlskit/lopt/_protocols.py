"""The contracts of the learned-optimizer code: ``UpdateRule``, ``Task`` and ``TaskFamily``.

Modelled on optax's ``GradientTransformation``: a learned optimizer is a triple of *pure*
functions over plain pytrees, and the inner problem is a handful of pure functions too, so the
same objects run under ``jit``, ``vmap`` and ``scan`` in the estimators, the ES workers, the
learner and the evaluation chief. Each is a ``typing.Protocol`` marked ``runtime_checkable``:
any object with these methods qualifies (``isinstance`` checks that the methods exist, not their
signatures), and the built-in classes subclass them to say so explicitly.

Rules and tasks are static arguments of ``jax.jit``: they must be hashable and compare equal when
they describe the same computation (frozen dataclasses do both).

A rule that also reads the run's loss and length (a learned *schedule*, issue 41) says so with the
class attribute ``uses_loss_and_num_steps = True``; its ``update`` then takes the keyword-only
arguments ``loss`` and ``num_steps``. Every caller goes through :func:`call_update`, the one place
that decides what a rule is given, so the rules, estimators, ES workers and evaluation paths written
for the five-argument ``update`` run unchanged.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np

PyTree = Any


@runtime_checkable
class UpdateRule(Protocol):
    """A (learned) update rule: three pure functions, like optax's ``init``/``update`` pair plus the
    meta-parameters it is a function of.

    * ``init_meta_params(key) -> meta_params``: a fresh pytree of real floating arrays.
    * ``init_state(params) -> state``: the per-run optimizer state for parameters ``params``.
    * ``update(meta_params, state, grads, params, time_scale) -> (updates, state)``: the step,
      added to the parameters (optax convention ``params + updates``); ``time_scale`` stretches the
      rule's time features when a run is longer or shorter than the one it was trained for.

    Optional: ``uses_loss_and_num_steps = True`` (class attribute; absent means ``False``) declares
    that ``update`` also takes ``loss=`` (the scalar loss at ``params``, whose gradient ``grads`` is)
    and ``num_steps=`` (the length of the whole run, a positive int or int scalar array; the rule
    counts its own steps). Call rules through :func:`call_update`.
    """

    def init_meta_params(self, key: jax.Array) -> PyTree:
        ...

    def init_state(self, params: PyTree) -> PyTree:
        ...

    def update(self, meta_params: PyTree, state: PyTree, grads: PyTree, params: PyTree,
               time_scale: float = 1.0) -> tuple[PyTree, PyTree]:
        ...


@runtime_checkable
class Task(Protocol):
    """One inner problem *structure*; its instances differ by ``task_params`` and by their keys.

    * ``sample_task_params(key) -> task_params`` (default ``{}``: instances differ only by keys)
    * ``init(key, task_params) -> params``
    * ``batch(key, task_params) -> batch`` (pure; data lives in memory, nothing downloads)
    * ``loss(params, batch, task_params) -> scalar``
    """

    def sample_task_params(self, key: jax.Array) -> PyTree:
        del key
        return {}

    def init(self, key: jax.Array, task_params: PyTree) -> PyTree:
        raise NotImplementedError

    def batch(self, key: jax.Array, task_params: PyTree) -> PyTree:
        raise NotImplementedError

    def loss(self, params: PyTree, batch: PyTree, task_params: PyTree) -> jax.Array:
        raise NotImplementedError


@runtime_checkable
class TaskFamily(Protocol):
    """A distribution over task structures: ``sample(rng) -> Task`` with a NumPy generator, and
    ``tasks()``, every structure it can produce (finite families; used for evaluation sets)."""

    def sample(self, rng: np.random.Generator) -> Task:
        raise NotImplementedError

    def tasks(self) -> tuple[Task, ...]:
        raise NotImplementedError


def uses_loss_and_num_steps(rule: UpdateRule) -> bool:
    """Whether ``rule.update`` takes the keywords ``loss=`` and ``num_steps=`` (its class attribute
    ``uses_loss_and_num_steps``; rules without it do not)."""
    return bool(getattr(rule, "uses_loss_and_num_steps", False))


def call_update(rule: UpdateRule, meta_params: PyTree, state: PyTree, grads: PyTree, params: PyTree,
                time_scale: float | jax.Array = 1.0, *, loss: jax.Array | None = None,
                num_steps: int | jax.Array | None = None) -> tuple[PyTree, PyTree]:
    """``rule.update(meta_params, state, grads, params, time_scale)``, plus ``loss=`` and ``num_steps=``
    for a rule that :func:`uses_loss_and_num_steps` (ValueError naming the one missing); the other
    rules are called as before and the two values are not given to them.

    The single place every caller (the inner step, the optax adapter, self-training) asks a rule
    for a step, so a rule's inputs are decided once.
    """
    if not uses_loss_and_num_steps(rule):
        return rule.update(meta_params, state, grads, params, time_scale)
    for name, value in (("loss", loss), ("num_steps", num_steps)):
        if value is None:
            raise ValueError(f"{name}: {type(rule).__name__} reads the run's loss and its length (num_steps); "
                             f"none was given")
    return rule.update(meta_params, state, grads, params, time_scale, loss=loss, num_steps=num_steps)
