"""Argument checks specific to the learned-optimizer code (pytrees of meta-parameters, parameters
and optimizer state), built on :mod:`carlskit._checks`, which holds the general ones (``integer``,
``positive_int``, ``finite_float``...; import those from there). Python only: they run at
construction or trace time, never inside a compiled computation.

Every error names the argument (and, for pytrees, the leaf path) and what was expected.
"""

from __future__ import annotations

from typing import Any, Iterable

import jax
import numpy as np

from carlskit._checks import positive_int
from carlskit.lopt._protocols import UpdateRule

PyTree = Any


def positive_ints(values: Iterable[Any], name: str, *, allow_empty: bool = False) -> tuple[int, ...]:
    """A tuple of positive ints (non-empty unless ``allow_empty``), e.g. layer widths."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{name} must be a tuple of positive ints, got {values!r}")
    values = tuple(values)
    if not values and not allow_empty:
        raise ValueError(f"{name} must be a non-empty tuple of positive ints, got ()")
    return tuple(positive_int(v, f"{name}[{i}]") for i, v in enumerate(values))


def _leaf_name(name: str, path: tuple) -> str:
    return name + jax.tree_util.keystr(path)


def check_real_floating(tree: PyTree, name: str) -> None:
    """TypeError naming the leaf path of the first leaf whose dtype is not real floating."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if hasattr(leaf, "dtype"):
            dtype = leaf.dtype
        else:  # np.result_type("x") would read the string as a dtype name
            try:
                dtype = np.asarray(leaf).dtype
            except (ValueError, TypeError):
                raise TypeError(f"{_leaf_name(name, path)}: a {type(leaf).__name__} that is not an array "
                                "(ragged or unconvertible)") from None
        if not jax.dtypes.issubdtype(dtype, np.floating):
            raise TypeError(f"{_leaf_name(name, path)}: dtype {dtype} is not a real floating dtype "
                            "(float16/bfloat16/float32/float64)")


def check_finite(tree: PyTree, name: str) -> None:
    """ValueError naming the first leaf holding NaN or inf (concrete arrays only; tracers are skipped)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, jax.core.Tracer):
            continue
        if not np.all(np.isfinite(np.asarray(leaf, np.float32))):
            raise ValueError(f"{_leaf_name(name, path)}: holds non-finite values (NaN or inf)")


def check_same_layout(reference: PyTree, reference_name: str, tree: PyTree, name: str,
                      leading_shape: tuple[int, ...] = ()) -> None:
    """``tree`` must have ``reference``'s pytree structure and, leaf by leaf, its shape with
    ``leading_shape`` in front; ValueError naming the leaf path and both shapes otherwise.

    E.g. ``grads['b']: shape (4,), params['b'] (2, 2)``.
    """
    want_def, got_def = jax.tree.structure(reference), jax.tree.structure(tree)
    if want_def != got_def:
        raise ValueError(f"{name}: pytree structure {got_def} differs from {reference_name} structure {want_def}")
    for (path, want), got in zip(jax.tree_util.tree_flatten_with_path(reference)[0], jax.tree.leaves(tree)):
        want_shape, got_shape = tuple(leading_shape) + tuple(np.shape(want)), tuple(np.shape(got))
        if want_shape != got_shape:
            raise ValueError(f"{_leaf_name(name, path)}: shape {got_shape}, "
                             f"{_leaf_name(reference_name, path)} {tuple(np.shape(want))}"
                             + (f" (expected {want_shape})" if leading_shape else ""))


def check_state_keys(state: Any, keys: tuple[str, ...], rule: UpdateRule) -> None:
    """``state`` must be the dict ``rule.init_state(params)`` makes (keys ``keys``)."""
    if not isinstance(state, dict) or set(state) != set(keys):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"state: expected {type(rule).__name__}.init_state(params), a dict with keys "
                         f"{sorted(keys)}, got {got}")


_META_TEMPLATES: dict[Any, PyTree] = {}
_REAL_FLOATING = frozenset(np.dtype(t) for t in (np.float16, jax.numpy.bfloat16, np.float32, np.float64))


def meta_params_template(rule: UpdateRule) -> PyTree:
    """Shapes and dtypes of ``rule.init_meta_params(key)`` (``jax.ShapeDtypeStruct`` leaves; cached per rule)."""
    try:
        hash(rule)
    except TypeError:  # an unhashable custom rule: not cached
        return jax.eval_shape(rule.init_meta_params, jax.random.PRNGKey(0))
    if rule not in _META_TEMPLATES:
        _META_TEMPLATES[rule] = jax.eval_shape(rule.init_meta_params, jax.random.PRNGKey(0))
    return _META_TEMPLATES[rule]


def _matches_template(template: PyTree, meta_params: PyTree) -> bool:
    """Fast path (a few microseconds, called once per outer step): same structure, shapes, floating dtypes."""
    leaves, treedef = jax.tree.flatten(meta_params)
    want_leaves, want_def = jax.tree.flatten(template)
    return treedef == want_def and all(
        getattr(leaf, "shape", None) == want.shape and getattr(leaf, "dtype", None) in _REAL_FLOATING
        for leaf, want in zip(leaves, want_leaves))


def check_meta_params(rule: UpdateRule, meta_params: PyTree, name: str = "meta_params", *, finite: bool = False,
                      structure_error: type[Exception] = TypeError) -> None:
    """``meta_params`` must match ``rule.init_meta_params``: pytree structure (else
    ``structure_error``), leaf shapes (else ValueError), real floating dtypes (else TypeError), and
    finite values if ``finite`` (else ValueError; concrete arrays only)."""
    template = meta_params_template(rule)
    if _matches_template(template, meta_params):
        if finite:
            check_finite(meta_params, name)
        return
    want_def, got_def = jax.tree.structure(template), jax.tree.structure(meta_params)
    if want_def != got_def:
        raise structure_error(f"{name}: expected pytree {want_def} (from {type(rule).__name__}.init_meta_params), "
                        f"got {got_def}")
    for (path, want), got in zip(jax.tree_util.tree_flatten_with_path(template)[0], jax.tree.leaves(meta_params)):
        if tuple(np.shape(got)) != tuple(want.shape):
            raise ValueError(f"{_leaf_name(name, path)}: shape {tuple(np.shape(got))}, "
                             f"{type(rule).__name__}.init_meta_params gives {tuple(want.shape)}")
    check_real_floating(meta_params, name)
    if finite:
        check_finite(meta_params, name)
