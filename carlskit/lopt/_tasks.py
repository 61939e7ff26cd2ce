"""The built-in inner problems for learned optimizers (Metz et al. 2022, Sec. 4): quadratics, digits
MLPs and a digits convnet, their families, and ``as_task_family`` (one ``Task`` as a family). The
``Task`` and ``TaskFamily`` protocols they implement live in :mod:`carlskit.lopt._protocols`.

A ``Task`` is a frozen, hashable description of one problem *structure* (so it can be a static
argument of ``jax.jit``). Instances of it differ by ``task_params`` (per-instance constants, e.g.
the curvature of a quadratic) and by the keys for initialisation and minibatches, and are vmapped:

* ``sample_task_params(key) -> task_params``    (``{}`` when instances only differ by keys)
* ``init(key, task_params) -> params``
* ``batch(key, task_params) -> batch``          (pure; data lives in memory, nothing downloads)
* ``loss(params, batch, task_params) -> scalar``

A ``TaskFamily`` samples task structures: ``family.sample(rng) -> Task`` with a NumPy generator.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from carlskit._checks import finite_float, positive_int
from carlskit.lopt._checks import positive_ints
from carlskit.lopt._protocols import Task, TaskFamily

PyTree = Any

ACTIVATIONS = {"relu": jax.nn.relu, "tanh": jnp.tanh, "elu": jax.nn.elu, "gelu": jax.nn.gelu}


# ----------------------------------------------------------------------------------- quadratic
@dataclasses.dataclass(frozen=True)
class QuadraticTask(Task):
    """``L(x) = 1/2 sum_i s_i (x_i - c_i - n_i)^2`` with per-instance scales ``s`` (log-uniform over
    ``[1/condition, 1]``) and centre ``c``, minibatch noise ``n ~ N(0, noise_std^2)``."""

    dim: int = 8
    condition: float = 10.0
    noise_std: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "dim", positive_int(self.dim, "dim"))
        _check_quadratic_constants(self)

    def sample_task_params(self, key: jax.Array) -> PyTree:
        scale_key, centre_key = jax.random.split(key)
        log_scales = jax.random.uniform(scale_key, (self.dim,), minval=-math.log(self.condition), maxval=0.0)
        return {"scales": jnp.exp(log_scales), "centre": jax.random.normal(centre_key, (self.dim,))}

    def init(self, key: jax.Array, task_params: PyTree) -> PyTree:
        return {"x": jax.random.normal(key, (self.dim,), jnp.float32)}

    def batch(self, key: jax.Array, task_params: PyTree) -> PyTree:
        return self.noise_std * jax.random.normal(key, (self.dim,), jnp.float32)

    def loss(self, params: PyTree, batch: PyTree, task_params: PyTree) -> jax.Array:
        residual = params["x"] - task_params["centre"] - batch
        return 0.5 * jnp.sum(task_params["scales"] * jnp.square(residual))


@dataclasses.dataclass(frozen=True)
class QuadraticFamily(TaskFamily):
    """Quadratics of the given dimensions (scales and centres sampled per instance)."""

    dims: tuple[int, ...] = (4, 8, 16)
    condition: float = 10.0
    noise_std: float = 0.1

    def __post_init__(self) -> None:
        object.__setattr__(self, "dims", positive_ints(self.dims, "dims"))
        _check_quadratic_constants(self)

    def tasks(self) -> tuple[Task, ...]:
        return tuple(QuadraticTask(d, self.condition, self.noise_std) for d in self.dims)

    def sample(self, rng: np.random.Generator) -> Task:
        return self.tasks()[int(rng.integers(len(self.dims)))]


def _check_quadratic_constants(task: Any) -> None:
    """``condition >= 1`` (scales log-uniform over ``[1/condition, 1]``) and ``noise_std >= 0``, finite."""
    object.__setattr__(task, "condition", finite_float(task.condition, "condition", minimum=1.0))
    object.__setattr__(task, "noise_std", finite_float(task.noise_std, "noise_std", minimum=0.0))


def _check_activation(activation: Any, name: str = "activation") -> None:
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"{name} must be one of {sorted(ACTIVATIONS)}, got {activation!r}")


# ------------------------------------------------------------------------------- digits 8x8
@functools.lru_cache(maxsize=1)
def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """sklearn's bundled 8x8 digits (1797 images, no download), pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    return (digits.data / 16.0).astype(np.float32), digits.target.astype(np.int32)


def _digits_batch(key: jax.Array, batch_size: int) -> dict[str, jax.Array]:
    images, labels = digits_arrays()
    index = jax.random.randint(key, (batch_size,), 0, images.shape[0])
    return {"image": jnp.asarray(images)[index], "label": jnp.asarray(labels)[index]}


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, labels[:, None], -1)[:, 0])


@dataclasses.dataclass(frozen=True)
class DigitsMLPTask(Task):
    """MLP classifier on 8x8 digits (64 inputs, 10 classes), softmax cross-entropy on minibatches."""

    hidden_sizes: tuple[int, ...] = (32,)
    activation: str = "relu"
    batch_size: int = 128

    def __post_init__(self) -> None:
        _check_activation(self.activation)
        object.__setattr__(self, "hidden_sizes", positive_ints(self.hidden_sizes, "hidden_sizes", allow_empty=True))
        object.__setattr__(self, "batch_size", positive_int(self.batch_size, "batch_size"))

    def init(self, key: jax.Array, task_params: PyTree) -> PyTree:
        sizes = (64, *self.hidden_sizes, 10)
        keys = jax.random.split(key, len(sizes) - 1)
        return [
            {"w": jax.random.normal(k, (a, b), jnp.float32) / math.sqrt(a), "b": jnp.zeros((b,), jnp.float32)}
            for k, a, b in zip(keys, sizes[:-1], sizes[1:])
        ]

    def batch(self, key: jax.Array, task_params: PyTree) -> PyTree:
        return _digits_batch(key, self.batch_size)

    def loss(self, params: PyTree, batch: PyTree, task_params: PyTree) -> jax.Array:
        act = ACTIVATIONS[self.activation]
        hidden = batch["image"]
        for layer in params[:-1]:
            hidden = act(hidden @ layer["w"] + layer["b"])
        return _cross_entropy(hidden @ params[-1]["w"] + params[-1]["b"], batch["label"])


@dataclasses.dataclass(frozen=True)
class DigitsMLPFamily(TaskFamily):
    """MLPs on 8x8 digits with sampled width, depth and activation (one width for all layers)."""

    widths: tuple[int, ...] = (16, 32, 64)
    depths: tuple[int, ...] = (1, 2)
    activations: tuple[str, ...] = ("relu", "tanh")
    batch_size: int = 128

    def __post_init__(self) -> None:
        object.__setattr__(self, "widths", positive_ints(self.widths, "widths"))
        object.__setattr__(self, "depths", positive_ints(self.depths, "depths"))
        if isinstance(self.activations, str) or not self.activations:
            raise ValueError(f"activations must be a non-empty tuple of names, got {self.activations!r}")
        object.__setattr__(self, "activations", tuple(self.activations))
        for i, activation in enumerate(self.activations):
            _check_activation(activation, f"activations[{i}]")
        object.__setattr__(self, "batch_size", positive_int(self.batch_size, "batch_size"))

    def tasks(self) -> tuple[Task, ...]:
        return tuple(
            DigitsMLPTask((w,) * d, a, self.batch_size)
            for w in self.widths for d in self.depths for a in self.activations
        )

    def sample(self, rng: np.random.Generator) -> Task:
        tasks = self.tasks()
        return tasks[int(rng.integers(len(tasks)))]


@dataclasses.dataclass(frozen=True)
class DigitsConvTask(Task):
    """Small convnet on 8x8 digits: conv3x3(c1) - relu - conv3x3 stride 2 (c2) - relu - mean pool - dense.

    (Stride 2 = every second output of the stride-1 convolution, same as a strided conv.)
    """

    channels: tuple[int, int] = (8, 16)
    batch_size: int = 128

    def __post_init__(self) -> None:
        channels = positive_ints(self.channels, "channels")
        if len(channels) != 2:
            raise ValueError(f"channels must be 2 positive ints (conv1, conv2), got {self.channels!r}")
        object.__setattr__(self, "channels", channels)
        object.__setattr__(self, "batch_size", positive_int(self.batch_size, "batch_size"))

    def init(self, key: jax.Array, task_params: PyTree) -> PyTree:
        k1, k2, k3 = jax.random.split(key, 3)
        c1, c2 = self.channels
        return {
            "conv1": {"w": jax.random.normal(k1, (3, 3, 1, c1)) / 3.0, "b": jnp.zeros((c1,))},
            "conv2": {"w": jax.random.normal(k2, (3, 3, c1, c2)) / math.sqrt(9 * c1), "b": jnp.zeros((c2,))},
            "dense": {"w": jax.random.normal(k3, (c2, 10)) / math.sqrt(c2), "b": jnp.zeros((10,))},
        }

    def batch(self, key: jax.Array, task_params: PyTree) -> PyTree:
        return _digits_batch(key, self.batch_size)

    def loss(self, params: PyTree, batch: PyTree, task_params: PyTree) -> jax.Array:
        x = batch["image"].reshape(-1, 8, 8, 1)
        x = jax.nn.relu(_conv3x3_same(x, params["conv1"]["w"]) + params["conv1"]["b"])
        x = _conv3x3_same(x, params["conv2"]["w"])[:, 1::2, 1::2, :]  # stride 2, as lax SAME pads
        x = jax.nn.relu(x + params["conv2"]["b"]).mean(axis=(1, 2))
        return _cross_entropy(x @ params["dense"]["w"] + params["dense"]["b"], batch["label"])


def _conv3x3_same(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """3x3 'SAME' convolution (NHWC, HWIO) as nine shifted patches and one matmul.

    Same result as ``lax.conv_general_dilated``; written as a matmul because vmapped convolutions
    become grouped convolutions, which XLA's CPU backend runs very slowly.
    """
    height, width = x.shape[1], x.shape[2]
    padded = jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    patches = jnp.concatenate([padded[:, i:i + height, j:j + width, :] for i in range(3) for j in range(3)], axis=-1)
    return patches @ kernel.reshape(-1, kernel.shape[-1])


# ----------------------------------------------------------------------------------- one task as a family
class SingleTaskFamily(TaskFamily):
    """The family that always samples ``task``."""

    def __init__(self, task: Task) -> None:
        self.task = task

    def __repr__(self) -> str:
        return f"SingleTaskFamily({self.task!r})"

    def tasks(self) -> tuple[Task, ...]:
        return (self.task,)

    def sample(self, rng: np.random.Generator) -> Task:
        del rng
        return self.task


def as_task_family(task_family: TaskFamily | Task, name: str = "task_family") -> TaskFamily:
    """``task_family`` itself, or a :class:`SingleTaskFamily` of a single ``Task``; TypeError otherwise."""
    if isinstance(task_family, Task):
        return SingleTaskFamily(task_family)
    if not isinstance(task_family, TaskFamily):
        raise TypeError(f"{name} must be a TaskFamily or Task, got {type(task_family).__name__}")
    return task_family
