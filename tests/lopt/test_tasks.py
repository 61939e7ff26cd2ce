import jax
import jax.numpy as jnp
import numpy as np
import pytest

from carlskit.lopt import DigitsConvTask, DigitsMLPFamily, DigitsMLPTask, QuadraticFamily, QuadraticTask


@pytest.mark.parametrize("task", [QuadraticTask(5), DigitsMLPTask((8, 8), "tanh", 16), DigitsConvTask((4, 8), 16)],
                         ids=["quadratic", "mlp", "conv"])
def test_task_loss_and_gradients(task):
    @jax.jit
    def init_and_grad(key):
        task_params = task.sample_task_params(key)
        params = task.init(key, task_params)
        return params, jax.value_and_grad(task.loss)(params, task.batch(key, task_params), task_params)

    params, (loss, grads) = init_and_grad(jax.random.PRNGKey(0))
    assert loss.shape == () and bool(jnp.isfinite(loss))
    assert jax.tree.structure(grads) == jax.tree.structure(params)


def test_families_sample_hashable_structures():
    rng = np.random.default_rng(0)
    family = DigitsMLPFamily()
    sampled = {family.sample(rng) for _ in range(50)}
    assert sampled <= set(family.tasks()) and len(sampled) > 3
    assert len(family.tasks()) == 3 * 2 * 2
    assert QuadraticFamily(dims=(3,)).sample(rng) == QuadraticTask(3, 10.0, 0.1)
    with pytest.raises(ValueError, match="activation"):
        DigitsMLPTask((8,), "swishy")


def test_conv_matches_lax_convolution():
    from carlskit.lopt._tasks import _conv3x3_same

    x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 8, 3))
    kernel = jax.random.normal(jax.random.PRNGKey(1), (3, 3, 3, 5))
    reference = jax.lax.conv_general_dilated(x, kernel, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    np.testing.assert_allclose(_conv3x3_same(x, kernel), reference, rtol=1e-4, atol=1e-4)
    strided = jax.lax.conv_general_dilated(x, kernel, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    np.testing.assert_allclose(_conv3x3_same(x, kernel)[:, 1::2, 1::2], strided, rtol=1e-4, atol=1e-4)


def test_task_configuration_errors_name_the_field():
    cases = [
        (lambda: QuadraticTask(condition=0), ValueError, "condition"),
        (lambda: QuadraticTask(dim=0), ValueError, "dim"),
        (lambda: QuadraticTask(noise_std=-0.1), ValueError, "noise_std"),
        (lambda: QuadraticFamily(dims=()), ValueError, "dims"),
        (lambda: QuadraticFamily(dims=(4, 2.5)), TypeError, r"dims\[1\]"),
        (lambda: DigitsMLPFamily(widths=()), ValueError, "widths"),
        (lambda: DigitsMLPFamily(depths=(0,)), ValueError, "depths"),
        (lambda: DigitsMLPFamily(activations=("relu", "swish")), ValueError, "activations"),
        (lambda: DigitsMLPTask(batch_size=0), ValueError, "batch_size"),
        (lambda: DigitsMLPTask(hidden_sizes=(2.7,)), TypeError, "hidden_sizes"),
        (lambda: DigitsConvTask(channels=(8,)), ValueError, "channels"),
        (lambda: DigitsConvTask(batch_size=-1), ValueError, "batch_size"),
    ]
    for make, error, field in cases:
        with pytest.raises(error, match=field):
            make()
    assert DigitsMLPTask(hidden_sizes=[np.int64(8)]) == DigitsMLPTask(hidden_sizes=(8,))  # hashable, normalised
    assert DigitsMLPTask(hidden_sizes=()).init(jax.random.PRNGKey(0), {})[0]["w"].shape == (64, 10)
