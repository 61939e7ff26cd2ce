"""One training step, shared by :class:`carlskit.training.Trainer` and :meth:`carlskit.moe.MoEModel.fit`.

The step is a pure function of the ``(model, nnx.Optimizer)`` state and a batch: a fix to it is one
edit that both training loops see.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.flatten_util import ravel_pytree
from jax.sharding import PartitionSpec

#: batch entries holding bank embedding rows (``carlskit.training._embeddings``), differentiated too
BANK_ROWS = "bank_rows/"

StepFn = Callable[[nnx.State, Any], tuple[nnx.State, jax.Array, dict, jax.Array]]


def make_train_step(graphdef: nnx.GraphDef, loss_fn: Callable[[nnx.Module, Any], tuple[jax.Array, dict]], *,
                    check_finite: bool = True, bank_rows: bool = False,
                    local_mesh: jax.sharding.Mesh | None = None) -> StepFn:
    """``train_step(state, batch) -> (new_state, loss, metrics, finite)`` for the state of
    ``nnx.split((model, nnx.Optimizer(model, tx, wrt=nnx.Param)))`` (``graphdef`` from that split).

    The gradient of ``loss_fn(model, batch) -> (loss, metrics)`` with respect to the model's
    ``nnx.Param`` variables is applied by the optimizer (``tx.update``, then ``optax.apply_updates``).
    ``finite`` is True when every inexact leaf of the new state (weights and optimizer state) is
    finite: a finite loss can still come with non-finite gradients (e.g. sqrt at 0). With
    ``check_finite=False`` that reduction is skipped and ``finite`` is a constant True. Pure: the
    caller jits it (with whatever shardings its state and batch carry).

    With ``bank_rows=True`` the loss is differentiated with respect to the batch's
    ``bank_rows/<table>`` inputs too (rows of bank embedding tables, one per distinct id:
    :mod:`carlskit.training._embeddings`), and the step returns a fifth output, their gradients
    ``{name: [U, dim]}`` (each row's, summed over every use of its id); the bank applies them.

    With ``local_mesh`` (a mesh of one axis, the state replicated over it) the gradients are those
    of the *local* losses (PyTorch DDP's semantics): every device evaluates ``loss_fn`` on its
    rows (arrays whose leading dimension splits over the mesh; the others whole), and one
    all-reduce of a single flat buffer averages the gradients, the loss, the floating metrics and
    the floating non-``Param`` state the loss wrote (e.g. batch statistics) over the devices.
    For a loss that is a mean over rows that equals the global step; a loss that couples rows
    (in-batch negatives) sees only each device's rows. Why: XLA's CPU and gloo run the global
    step's gradient all-reduce as one collective per parameter; one buffer is one collective
    (``benchmarks/multi_process.py``).
    """
    if local_mesh is not None:
        if bank_rows:
            raise ValueError("a step with local losses (local_mesh) cannot differentiate bank rows")
        return _local_train_step(graphdef, loss_fn, local_mesh, check_finite)

    def train_step(state: nnx.State, batch: Any):
        model, optimizer = nnx.merge(graphdef, state)
        if bank_rows:
            rows = {k: v for k, v in batch.items() if k.startswith(BANK_ROWS)}
            rest = {k: v for k, v in batch.items() if not k.startswith(BANK_ROWS)}

            def loss_of_rows(model, rows):
                return loss_fn(model, {**rest, **rows})

            (loss, metrics), (grads, row_grads) = nnx.value_and_grad(
                loss_of_rows, argnums=(0, 1), has_aux=True)(model, rows)
        else:
            (loss, metrics), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
        optimizer.update(model, grads)
        new_state = nnx.state((model, optimizer))
        finite = all_finite((new_state, row_grads) if bank_rows else new_state) if check_finite \
            else jnp.asarray(True)
        if bank_rows:
            return new_state, loss, metrics, finite, row_grads
        return new_state, loss, metrics, finite

    return train_step


def _local_train_step(graphdef: nnx.GraphDef, loss_fn: Callable, mesh: jax.sharding.Mesh,
                      check_finite: bool) -> StepFn:
    (axis,) = mesh.axis_names
    size = mesh.devices.size

    def local_gradients(state: nnx.State, batch: Any):
        model, _ = nnx.merge(graphdef, state)
        (loss, metrics), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
        written = nnx.state(model, nnx.Not(nnx.Param))
        floating = lambda leaf: jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)  # noqa: E731
        averaged = {"grads": grads, "loss": loss,
                    "metrics": jax.tree.map(lambda v: v if floating(v) else None, metrics),
                    "written": jax.tree.map(lambda v: v if floating(v) else None, written)}
        flat, unravel = ravel_pytree(averaged)  # one buffer: one all-reduce
        averaged = unravel(jax.lax.pmean(flat, axis))
        # integer metrics are averaged on their own; integer state (e.g. RNG counts) is the same everywhere
        metrics = jax.tree.map(lambda v, a: a if floating(v) else jax.lax.pmean(v, axis), metrics,
                               averaged["metrics"])
        written = jax.tree.map(lambda v, a: a if floating(v) else v, written, averaged["written"])
        return averaged["grads"], averaged["loss"], metrics, written

    def spec(leaf: Any) -> PartitionSpec:  # as the trainer places a batch: rows split when they divide
        return PartitionSpec(axis) if jnp.ndim(leaf) and jnp.shape(leaf)[0] % size == 0 else PartitionSpec()

    def train_step(state: nnx.State, batch: Any):
        gradients = jax.shard_map(local_gradients, mesh=mesh, in_specs=(PartitionSpec(), jax.tree.map(spec, batch)),
                                  out_specs=PartitionSpec(), check_vma=False)
        grads, loss, metrics, written = gradients(state, batch)
        model, optimizer = nnx.merge(graphdef, state)
        nnx.update(model, written)
        optimizer.update(model, grads)
        new_state = nnx.state((model, optimizer))
        finite = all_finite(new_state) if check_finite else jnp.asarray(True)
        return new_state, loss, metrics, finite

    return train_step


def all_finite(tree: Any) -> jax.Array:
    """One fused reduction: True when every inexact (floating or complex) leaf of ``tree`` is finite."""
    leaves = [jnp.isfinite(leaf).all() for leaf in jax.tree.leaves(tree) if jnp.issubdtype(leaf.dtype, jnp.inexact)]
    return jnp.all(jnp.array(leaves or [True]))
