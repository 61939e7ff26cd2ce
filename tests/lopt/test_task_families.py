"""The meta-training distribution of the shipped optimizer: scikit-learn data-set tasks, autoencoders,
least squares, their families, the mixture, and the held-out problems it never saw."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from carlskit.lopt import (
    DATASETS,
    AutoencoderFamily,
    AutoencoderTask,
    ConvFamily,
    DigitsConvTask,
    LinearRegressionFamily,
    LinearRegressionTask,
    MixtureFamily,
    MLPFamily,
    MLPTask,
    QuadraticFamily,
    Task,
    TaskFamily,
    dataset_arrays,
    held_out_problems,
    meta_training_family,
)


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_datasets_are_standardised_like_sklearn(name):
    import sklearn.datasets
    from sklearn.preprocessing import StandardScaler

    features, targets, outputs = dataset_arrays(name)
    raw = getattr(sklearn.datasets, f"load_{name}")()
    expected = StandardScaler().fit_transform(raw.data)
    # StandardScaler leaves constant columns at 0 (scale 1); so do we (std floored).
    np.testing.assert_allclose(features, expected, atol=2e-5)
    if DATASETS[name] == "classification":
        assert targets.dtype == np.int32 and outputs == len(np.unique(raw.target))
    else:
        assert outputs == 1 and abs(targets.mean()) < 1e-5 and abs(targets.std() - 1) < 1e-4


def _loss_and_grads(task: Task, seed: int = 0):
    key = jax.random.PRNGKey(seed)
    task_params = task.sample_task_params(key) if hasattr(task, "sample_task_params") else {}
    params = task.init(jax.random.fold_in(key, 1), task_params)
    batch = task.batch(jax.random.fold_in(key, 2), task_params)
    loss, grads = jax.jit(jax.value_and_grad(task.loss))(params, batch, task_params)  # one compile, not op by op
    return float(loss), params, grads


@pytest.mark.parametrize("task", [MLPTask("iris", (8,), "tanh", 16), MLPTask("diabetes", (), "relu", 16),
                                  AutoencoderTask("wine", (8, 2, 8), "relu", 16),
                                  LinearRegressionTask(6, 50.0, 8)], ids=repr)
def test_tasks_give_finite_losses_of_order_one_and_matching_gradients(task):
    loss, params, grads = _loss_and_grads(task)
    assert np.isfinite(loss) and 0.01 < loss < 10.0  # standardised data: losses start near 1
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    assert all(g.shape == p.shape for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(params)))


def test_classification_starts_near_chance_and_regression_learns():
    loss, _, _ = _loss_and_grads(MLPTask("digits", (), "relu", 256))
    assert abs(loss - math.log(10)) < 1.0  # logistic regression with 1/sqrt(d) weights: near log(10)
    # A linear least-squares model on diabetes falls well below the variance (0.5) by plain descent.
    task = MLPTask("diabetes", (), "relu", 442)
    params = task.init(jax.random.PRNGKey(0), {})
    batch = {"x": jnp.asarray(dataset_arrays("diabetes")[0]), "y": jnp.asarray(dataset_arrays("diabetes")[1])}
    grad = jax.jit(jax.grad(task.loss))
    for _ in range(300):
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grad(params, batch, {}))
    assert float(task.loss(params, batch, {})) < 0.3


def test_linear_regression_has_the_conditioning_it_says():
    task = LinearRegressionTask(16, 1000.0, 4)
    scales = np.asarray(task.sample_task_params(jax.random.PRNGKey(3))["scales"])
    hessian_condition = (scales.max() / scales.min()) ** 2  # E[x x^T] = diag(scales^2)
    assert 10.0 < hessian_condition <= 1000.0 * (1 + 1e-5)


def test_families_enumerate_and_sample_their_structures():
    family = MLPFamily(("iris", "wine"), (8, 16), (0, 1), ("relu", "tanh"), (32,))
    tasks = family.tasks()
    # depth 0 is one linear model per data set and batch size, whatever width and activation
    assert len(tasks) == 2 * 1 + 2 * 2 * 2 and len(set(tasks)) == len(tasks)
    rng = np.random.default_rng(0)
    assert {family.sample(rng) for _ in range(200)} == set(tasks)
    assert len(AutoencoderFamily().tasks()) == 4 and len(LinearRegressionFamily().tasks()) == 12
    assert len(ConvFamily().tasks()) == 4 and all(isinstance(t, DigitsConvTask) for t in ConvFamily().tasks())
    for f in (family, AutoencoderFamily(), LinearRegressionFamily(), ConvFamily(), meta_training_family()):
        assert isinstance(f, TaskFamily)


def test_mixture_samples_by_weight_and_is_reproducible():
    first, second = QuadraticFamily(dims=(4,)), LinearRegressionFamily(dims=(8,), conditions=(1.0,), batch_sizes=(8,))
    mixture = MixtureFamily([first, second], weights=[3.0, 1.0])
    draws = [mixture.sample(np.random.default_rng(1)) for _ in range(2)]
    assert draws[0] == draws[1]
    rng = np.random.default_rng(0)
    counts = [0, 0]
    for _ in range(400):
        counts[isinstance(mixture.sample(rng), LinearRegressionTask)] += 1
    assert 0.18 < counts[1] / 400 < 0.32  # weight 1/4
    assert set(mixture.tasks()) == set(first.tasks()) | set(second.tasks())


def test_held_out_problems_are_never_sampled_in_meta_training():
    training = set(meta_training_family().tasks())
    problems = held_out_problems()
    assert len(problems) >= 6 and not training & set(problems.values())
    # whole kinds are held out: no autoencoder, convnet, breast-cancer or diabetes task, no gelu/elu,
    # no depth 3, no batch 16, no condition 1000 in training
    for task in training:
        assert not isinstance(task, (AutoencoderTask, DigitsConvTask))
        if isinstance(task, MLPTask):
            assert task.dataset not in ("breast_cancer", "diabetes") and task.activation in ("relu", "tanh")
            assert len(task.hidden_sizes) <= 2 and task.batch_size != 16
        if isinstance(task, LinearRegressionTask):
            assert task.condition <= 100.0


@pytest.mark.parametrize("build, message", [
    (lambda: MLPTask("mnist"), "dataset must be one of"),
    (lambda: MLPTask("iris", (0,)), r"hidden_sizes\[0\]"),
    (lambda: MLPTask("iris", activation="swish"), "activation must be one of"),
    (lambda: AutoencoderTask(batch_size=0), "batch_size"),
    (lambda: LinearRegressionTask(condition=0.5), "condition"),
    (lambda: MLPFamily(datasets="iris"), "datasets must be a non-empty tuple"),
    (lambda: MLPFamily(depths=(-1,)), r"depths\[0\]"),
    (lambda: MLPFamily(activations=("relu", "swish")), "activation"),
    (lambda: LinearRegressionFamily(conditions=(0.1,)), r"conditions\[0\]"),
    (lambda: ConvFamily(channels=((4,),)), "channels"),
    (lambda: MixtureFamily([]), "families must be a non-empty tuple"),
    (lambda: MixtureFamily([QuadraticFamily()], weights=[-1.0]), "weights"),
    (lambda: MixtureFamily([object()]), r"families\[0\] must be a TaskFamily"),
])
def test_bad_configuration_names_the_argument(build, message):
    with pytest.raises((TypeError, ValueError), match=message):
        build()
