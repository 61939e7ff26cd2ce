"""The Trainer options MoEModel.fit and TranslationModel.fit train with (``check_finite=False``,
``array_metrics=True``), and the remote run's transport knowing nothing of the Trainer."""

import ast
import pathlib

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tiny_models import Linear, sum_batch

import carlskit.training
from carlskit.training import Trainer


def with_array_metric(model, batch):
    error = model(batch["x"]) - batch["y"]
    return jnp.mean(error**2), {"abs_error": jnp.abs(error), "worst": jnp.max(jnp.abs(error))}


def test_array_metrics_are_kept_as_arrays_and_refused_by_default():
    history = Trainer(Linear(), optax.sgd(0.01), with_array_metric, array_metrics=True).fit(
        sum_batch, 3, progress=False, live=False)
    assert history.column("abs_error").shape == (3, 8) and history.column("worst").shape == (3,)
    with pytest.raises(ValueError, match=r"metrics must be scalars, got shapes \{'abs_error': \(8,\)\}"):
        Trainer(Linear(), optax.sgd(0.01), with_array_metric).fit(sum_batch, 1, progress=False, live=False)
    with pytest.raises(TypeError, match="array_metrics must be a bool"):
        Trainer(Linear(), optax.sgd(0.01), with_array_metric, array_metrics="yes")


def test_without_the_finiteness_check_a_non_finite_step_is_committed_as_optax_would():
    def nan_at_step_two(step):
        batch = sum_batch(step)
        return {**batch, "y": batch["y"] * (np.nan if step == 1 else 1.0)}

    def mse(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2), {}

    unchecked = Trainer(Linear(), optax.sgd(0.01), mse, check_finite=False)
    history = unchecked.fit(nan_at_step_two, 3, progress=False, live=False)
    assert unchecked.step == 3 and np.isnan(history[1]["loss"])
    checked = Trainer(Linear(), optax.sgd(0.01), mse)
    with pytest.raises(ValueError, match="non-finite loss"):
        checked.fit(nan_at_step_two, 3, progress=False, live=False)
    assert checked.step == 1  # the default commits nothing non-finite


def test_the_remote_transport_neither_imports_the_trainer_nor_reads_its_attributes():
    path = pathlib.Path(carlskit.training.__file__).parent / "_remote.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any(module.startswith("carlskit.training") for module in imported), imported
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    assert "trainer" not in names and "Trainer" not in names
