"""The built-in inner problems for learned optimizers (Metz et al. 2020, Sec. 4): quadratics, digits
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

from carlskit._checks import choice, finite_float, integer, positive_int
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


# ------------------------------------------------------------------- scikit-learn data sets
# Bundled with scikit-learn (nothing downloads). Features are standardised per column; regression
# targets too, so every loss starts near 1 and the outer losses of different families are comparable.
#: The scikit-learn data sets the built-in task families train on, each with its kind
#: (``classification`` or ``regression``).
DATASETS: dict[str, str] = {"digits": "classification", "iris": "classification", "wine": "classification",
                            "breast_cancer": "classification", "diabetes": "regression"}


@functools.lru_cache(maxsize=None)
def dataset_arrays(name: str) -> tuple[np.ndarray, np.ndarray, int]:
    """``(features [n, d] float32 standardised, targets [n], num_outputs)`` of a bundled scikit-learn
    data set: int32 labels and the number of classes, or a standardised float32 target and 1."""
    _check_dataset(name)
    import sklearn.datasets

    data = getattr(sklearn.datasets, f"load_{name}")()
    features = data.data.astype(np.float64)
    features = (features - features.mean(0)) / np.maximum(features.std(0), 1e-8)
    if DATASETS[name] == "classification":
        labels = data.target.astype(np.int32)
        return features.astype(np.float32), labels, int(labels.max()) + 1
    target = data.target.astype(np.float64)
    return features.astype(np.float32), ((target - target.mean()) / target.std()).astype(np.float32), 1


def _check_dataset(name: Any) -> None:
    if not isinstance(name, str) or name not in DATASETS:
        raise ValueError(f"dataset must be one of {sorted(DATASETS)}, got {name!r}")


def _dataset_batch(name: str, key: jax.Array, batch_size: int) -> dict[str, jax.Array]:
    features, targets, _ = dataset_arrays(name)
    index = jax.random.randint(key, (batch_size,), 0, features.shape[0])
    return {"x": jnp.asarray(features)[index], "y": jnp.asarray(targets)[index]}


def _mlp_init(key: jax.Array, sizes: tuple[int, ...]) -> list[dict[str, jax.Array]]:
    keys = jax.random.split(key, len(sizes) - 1)
    return [{"w": jax.random.normal(k, (a, b), jnp.float32) / math.sqrt(a), "b": jnp.zeros((b,), jnp.float32)}
            for k, a, b in zip(keys, sizes[:-1], sizes[1:])]


def _mlp_apply(params: list[dict[str, jax.Array]], x: jax.Array, activation: str) -> jax.Array:
    act = ACTIVATIONS[activation]
    for layer in params[:-1]:
        x = act(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def _check_network(task: Any) -> None:
    _check_dataset(task.dataset)
    _check_activation(task.activation)
    object.__setattr__(task, "hidden_sizes", positive_ints(task.hidden_sizes, "hidden_sizes", allow_empty=True))
    object.__setattr__(task, "batch_size", positive_int(task.batch_size, "batch_size"))


@dataclasses.dataclass(frozen=True)
class MLPTask(Task):
    """MLP on a bundled scikit-learn data set: softmax cross-entropy for the classification sets,
    ``1/2`` mean squared error for ``diabetes`` (standardised target). ``hidden_sizes=()`` is a
    linear (logistic or least-squares) model."""

    dataset: str = "iris"
    hidden_sizes: tuple[int, ...] = (32,)
    activation: str = "relu"
    batch_size: int = 64

    def __post_init__(self) -> None:
        _check_network(self)

    def init(self, key: jax.Array, task_params: PyTree) -> PyTree:
        features, _, outputs = dataset_arrays(self.dataset)
        return _mlp_init(key, (features.shape[1], *self.hidden_sizes, outputs))

    def batch(self, key: jax.Array, task_params: PyTree) -> PyTree:
        return _dataset_batch(self.dataset, key, self.batch_size)

    def loss(self, params: PyTree, batch: PyTree, task_params: PyTree) -> jax.Array:
        out = _mlp_apply(params, batch["x"], self.activation)
        if DATASETS[self.dataset] == "classification":
            return _cross_entropy(out, batch["y"])
        return 0.5 * jnp.mean(jnp.square(out[:, 0] - batch["y"]))


@dataclasses.dataclass(frozen=True)
class AutoencoderTask(Task):
    """MLP autoencoder ``x -> hidden_sizes -> x`` on a data set's standardised features, ``1/2`` mean
    squared reconstruction error (the middle entry of ``hidden_sizes`` is the bottleneck)."""

    dataset: str = "digits"
    hidden_sizes: tuple[int, ...] = (32, 8, 32)
    activation: str = "tanh"
    batch_size: int = 64

    def __post_init__(self) -> None:
        _check_network(self)

    def init(self, key: jax.Array, task_params: PyTree) -> PyTree:
        dim = dataset_arrays(self.dataset)[0].shape[1]
        return _mlp_init(key, (dim, *self.hidden_sizes, dim))

    def batch(self, key: jax.Array, task_params: PyTree) -> PyTree:
        return _dataset_batch(self.dataset, key, self.batch_size)

    def loss(self, params: PyTree, batch: PyTree, task_params: PyTree) -> jax.Array:
        return 0.5 * jnp.mean(jnp.square(_mlp_apply(params, batch["x"], self.activation) - batch["x"]))


@dataclasses.dataclass(frozen=True)
class LinearRegressionTask(Task):
    """Least squares ``1/2 mean((x w - y)^2)`` on fresh Gaussian minibatches whose input scales are
    log-uniform over ``[1/sqrt(condition), 1]`` (so the Hessian's condition number is about
    ``condition``), ``y = x w* + noise``; ``w*`` and the scales are sampled per instance."""

    dim: int = 16
    condition: float = 100.0
    batch_size: int = 32
    noise_std: float = 0.1

    def __post_init__(self) -> None:
        object.__setattr__(self, "dim", positive_int(self.dim, "dim"))
        object.__setattr__(self, "batch_size", positive_int(self.batch_size, "batch_size"))
        _check_quadratic_constants(self)

    def sample_task_params(self, key: jax.Array) -> PyTree:
        scale_key, weight_key = jax.random.split(key)
        log_scales = jax.random.uniform(scale_key, (self.dim,), minval=-0.5 * math.log(self.condition), maxval=0.0)
        target = jax.random.normal(weight_key, (self.dim,)) / math.sqrt(self.dim)
        return {"scales": jnp.exp(log_scales), "target": target}

    def init(self, key: jax.Array, task_params: PyTree) -> PyTree:
        return {"w": jnp.zeros((self.dim,), jnp.float32), "b": jnp.zeros((), jnp.float32)}

    def batch(self, key: jax.Array, task_params: PyTree) -> PyTree:
        x_key, noise_key = jax.random.split(key)
        x = jax.random.normal(x_key, (self.batch_size, self.dim)) * task_params["scales"]
        y = x @ task_params["target"] * math.sqrt(self.dim) + self.noise_std * jax.random.normal(
            noise_key, (self.batch_size,))
        return {"x": x, "y": y}

    def loss(self, params: PyTree, batch: PyTree, task_params: PyTree) -> jax.Array:
        return 0.5 * jnp.mean(jnp.square(batch["x"] @ params["w"] + params["b"] - batch["y"]))


@dataclasses.dataclass(frozen=True)
class DeepLinearTask(Task):
    """A deep linear network ``x W_1 ... W_depth`` (all ``width x width``) fitted to a random linear
    map ``y = x A`` on fresh Gaussian minibatches, ``1/2`` mean squared error. The product of
    matrices makes the landscape non-convex with saddle points and badly scaled directions (Saxe et
    al. 2014), which a step size tuned for one layer does not fit."""

    width: int = 16
    depth: int = 4
    batch_size: int = 32

    def __post_init__(self) -> None:
        for name in ("width", "depth", "batch_size"):
            object.__setattr__(self, name, positive_int(getattr(self, name), name))

    def sample_task_params(self, key: jax.Array) -> PyTree:
        return {"target": jax.random.normal(key, (self.width, self.width)) / math.sqrt(self.width)}

    def init(self, key: jax.Array, task_params: PyTree) -> PyTree:
        keys = jax.random.split(key, self.depth)
        return [jax.random.normal(k, (self.width, self.width), jnp.float32) / math.sqrt(self.width) for k in keys]

    def batch(self, key: jax.Array, task_params: PyTree) -> PyTree:
        x = jax.random.normal(key, (self.batch_size, self.width))
        return {"x": x, "y": x @ task_params["target"]}

    def loss(self, params: PyTree, batch: PyTree, task_params: PyTree) -> jax.Array:
        x = batch["x"]
        for weight in params:
            x = x @ weight
        return 0.5 * jnp.mean(jnp.square(x - batch["y"]))


@dataclasses.dataclass(frozen=True)
class MatrixCompletionTask(Task):
    """Low-rank matrix completion: factors ``U [rows, rank]``, ``V [cols, rank]`` fitted to minibatches
    of ``batch_size`` entries drawn from the ``observed`` fraction of a random rank-``rank`` matrix
    ``M = A B^T`` (unit-variance entries), ``1/2`` mean squared error on the drawn entries."""

    rows: int = 32
    cols: int = 32
    rank: int = 3
    observed: float = 0.3
    batch_size: int = 64

    def __post_init__(self) -> None:
        for name in ("rows", "cols", "rank", "batch_size"):
            object.__setattr__(self, name, positive_int(getattr(self, name), name))
        observed = finite_float(self.observed, "observed", minimum=0.0)
        if not 0.0 < observed <= 1.0:
            raise ValueError(f"observed must be a fraction in (0, 1], got {self.observed!r}")
        object.__setattr__(self, "observed", observed)

    def sample_task_params(self, key: jax.Array) -> PyTree:
        a_key, b_key, mask_key = jax.random.split(key, 3)
        a = jax.random.normal(a_key, (self.rows, self.rank))
        b = jax.random.normal(b_key, (self.cols, self.rank))
        # The observed entries: a fixed set per instance, as ``observed * rows * cols`` flat indexes.
        count = max(1, int(round(self.observed * self.rows * self.cols)))
        index = jax.random.permutation(mask_key, self.rows * self.cols)[:count]
        return {"matrix": a @ b.T / math.sqrt(self.rank), "index": index}

    def init(self, key: jax.Array, task_params: PyTree) -> PyTree:
        u_key, v_key = jax.random.split(key)
        scale = 1.0 / math.sqrt(self.rank)
        return {"u": jax.random.normal(u_key, (self.rows, self.rank)) * scale,
                "v": jax.random.normal(v_key, (self.cols, self.rank)) * scale}

    def batch(self, key: jax.Array, task_params: PyTree) -> PyTree:
        pick = jax.random.randint(key, (self.batch_size,), 0, task_params["index"].shape[0])
        flat = task_params["index"][pick]
        return {"row": flat // self.cols, "col": flat % self.cols}

    def loss(self, params: PyTree, batch: PyTree, task_params: PyTree) -> jax.Array:
        predicted = jnp.sum(params["u"][batch["row"]] * params["v"][batch["col"]], axis=-1)
        return 0.5 * jnp.mean(jnp.square(predicted - task_params["matrix"][batch["row"], batch["col"]]))


RESCALE_GRANULARITIES: tuple[str, ...] = ("tensor", "global", "entry")


@dataclasses.dataclass(frozen=True)
class RescaledTask(Task):
    """Task augmentation by parameter rescaling (VeLO; Metz et al. 2020, Sec. 4; Celo's weight-scale
    augmentation): the optimizer trains ``q`` with ``params = scale * q``, ``scale`` log-uniform over
    ``[1/max_scale, max_scale]`` per instance. The problem is the same, but the optimizer sees
    parameters scaled by ``1/scale`` and gradients by ``scale``, so it cannot key on their magnitudes.

    ``granularity``: one scale per parameter ``"tensor"`` (the default), one for the whole model
    (``"global"``) or one per ``"entry"``. Celo (Moudgil et al. 2025, Sec. 4) draws scales in
    ``[1e-3, 1e3]`` at each of the three: ``RescaledTask(task, 1e3, granularity)``."""

    task: Task
    max_scale: float = 10.0
    granularity: str = "tensor"

    def __post_init__(self) -> None:
        if not isinstance(self.task, Task):
            raise TypeError(f"task must be a Task, got {type(self.task).__name__}")
        object.__setattr__(self, "max_scale", finite_float(self.max_scale, "max_scale", minimum=1.0))
        object.__setattr__(self, "granularity", choice(self.granularity, "granularity", RESCALE_GRANULARITIES))

    def sample_task_params(self, key: jax.Array) -> PyTree:
        inner_key, scale_key = jax.random.split(key)
        inner = self.task.sample_task_params(inner_key)
        shapes = jax.eval_shape(lambda: self.task.init(jax.random.PRNGKey(0), inner))
        leaves = jax.tree.leaves(shapes)
        bound = math.log(self.max_scale)
        if self.granularity == "global":
            scale = jnp.exp(jax.random.uniform(scale_key, (), minval=-bound, maxval=bound))
            scales = [scale for _ in leaves]
        else:
            keys = jax.random.split(scale_key, len(leaves))
            scales = [jnp.exp(jax.random.uniform(k, leaf.shape if self.granularity == "entry" else (),
                                                 minval=-bound, maxval=bound)) for k, leaf in zip(keys, leaves)]
        return {"inner": inner, "scales": jax.tree.unflatten(jax.tree.structure(shapes), scales)}

    def init(self, key: jax.Array, task_params: PyTree) -> PyTree:
        params = self.task.init(key, task_params["inner"])
        return jax.tree.map(lambda p, s: p / s, params, task_params["scales"])

    def batch(self, key: jax.Array, task_params: PyTree) -> PyTree:
        return self.task.batch(key, task_params["inner"])

    def loss(self, params: PyTree, batch: PyTree, task_params: PyTree) -> jax.Array:
        scaled = jax.tree.map(lambda q, s: q * s, params, task_params["scales"])
        return self.task.loss(scaled, batch, task_params["inner"])


class RescaledFamily(TaskFamily):
    """``family``'s structures, each wrapped in :class:`RescaledTask` with probability ``probability``."""

    def __init__(self, family: TaskFamily, max_scale: float = 10.0, probability: float = 0.5) -> None:
        self.family = as_task_family(family, "family")
        self.max_scale = finite_float(max_scale, "max_scale", minimum=1.0)
        probability = finite_float(probability, "probability", minimum=0.0)
        if probability > 1.0:
            raise ValueError(f"probability must be in [0, 1], got {probability!r}")
        self.probability = probability

    def __repr__(self) -> str:
        return f"RescaledFamily({self.family!r}, max_scale={self.max_scale}, probability={self.probability})"

    def tasks(self) -> tuple[Task, ...]:
        return tuple(t for task in self.family.tasks() for t in (task, RescaledTask(task, self.max_scale)))

    def sample(self, rng: np.random.Generator) -> Task:
        task = self.family.sample(rng)
        return RescaledTask(task, self.max_scale) if rng.random() < self.probability else task


# --------------------------------------------------------------------------- families of them
def _names(values: Any, name: str, check: Any) -> tuple:
    if isinstance(values, str) or not isinstance(values, (tuple, list)) or not values:
        raise ValueError(f"{name} must be a non-empty tuple, got {values!r}")
    for i, value in enumerate(values):
        check(value, f"{name}[{i}]")
    return tuple(values)


class _EnumeratedFamily(TaskFamily):
    """A family that samples uniformly from its finite ``tasks()``."""

    def sample(self, rng: np.random.Generator) -> Task:
        tasks = self.tasks()
        return tasks[int(rng.integers(len(tasks)))]


@dataclasses.dataclass(frozen=True)
class MLPFamily(_EnumeratedFamily):
    """MLPs on bundled scikit-learn data sets with sampled data set, depth (0 = linear model), width,
    activation and batch size (one width for all hidden layers)."""

    datasets: tuple[str, ...] = ("digits", "iris", "wine")
    widths: tuple[int, ...] = (16, 64)
    depths: tuple[int, ...] = (0, 1, 2)
    activations: tuple[str, ...] = ("relu", "tanh")
    batch_sizes: tuple[int, ...] = (32, 128)

    def __post_init__(self) -> None:
        object.__setattr__(self, "datasets", _names(self.datasets, "datasets", lambda v, n: _check_dataset(v)))
        object.__setattr__(self, "widths", positive_ints(self.widths, "widths"))
        depths = _names(self.depths, "depths", lambda v, n: integer(v, n, 0))
        object.__setattr__(self, "depths", tuple(int(d) for d in depths))
        object.__setattr__(self, "activations", _names(self.activations, "activations", _check_activation))
        object.__setattr__(self, "batch_sizes", positive_ints(self.batch_sizes, "batch_sizes"))

    def tasks(self) -> tuple[Task, ...]:
        tasks = {MLPTask(d, (w,) * depth, a if depth else "relu", b)
                 for d in self.datasets for w in self.widths for depth in self.depths
                 for a in self.activations for b in self.batch_sizes}
        return tuple(sorted(tasks, key=repr))  # a linear model appears once, whatever width/activation


@dataclasses.dataclass(frozen=True)
class AutoencoderFamily(_EnumeratedFamily):
    """Autoencoders ``(width, bottleneck, width)`` on bundled data sets."""

    datasets: tuple[str, ...] = ("digits",)
    widths: tuple[int, ...] = (32,)
    bottlenecks: tuple[int, ...] = (4, 8)
    activations: tuple[str, ...] = ("tanh", "relu")
    batch_sizes: tuple[int, ...] = (64,)

    def __post_init__(self) -> None:
        object.__setattr__(self, "datasets", _names(self.datasets, "datasets", lambda v, n: _check_dataset(v)))
        object.__setattr__(self, "widths", positive_ints(self.widths, "widths"))
        object.__setattr__(self, "bottlenecks", positive_ints(self.bottlenecks, "bottlenecks"))
        object.__setattr__(self, "activations", _names(self.activations, "activations", _check_activation))
        object.__setattr__(self, "batch_sizes", positive_ints(self.batch_sizes, "batch_sizes"))

    def tasks(self) -> tuple[Task, ...]:
        return tuple(AutoencoderTask(d, (w, k, w), a, b) for d in self.datasets for w in self.widths
                     for k in self.bottlenecks for a in self.activations for b in self.batch_sizes)


@dataclasses.dataclass(frozen=True)
class LinearRegressionFamily(_EnumeratedFamily):
    """Least-squares problems (:class:`LinearRegressionTask`) of sampled dimension, conditioning and
    batch size."""

    dims: tuple[int, ...] = (8, 32)
    conditions: tuple[float, ...] = (1.0, 10.0, 100.0)
    batch_sizes: tuple[int, ...] = (16, 64)
    noise_std: float = 0.1

    def __post_init__(self) -> None:
        object.__setattr__(self, "dims", positive_ints(self.dims, "dims"))
        object.__setattr__(self, "conditions", _names(self.conditions, "conditions",
                                                      lambda v, n: finite_float(v, n, minimum=1.0)))
        object.__setattr__(self, "batch_sizes", positive_ints(self.batch_sizes, "batch_sizes"))
        object.__setattr__(self, "noise_std", finite_float(self.noise_std, "noise_std", minimum=0.0))

    def tasks(self) -> tuple[Task, ...]:
        return tuple(LinearRegressionTask(d, float(c), b, self.noise_std)
                     for d in self.dims for c in self.conditions for b in self.batch_sizes)


@dataclasses.dataclass(frozen=True)
class ConvFamily(_EnumeratedFamily):
    """Digits convnets (:class:`DigitsConvTask`) of sampled channel widths and batch size."""

    channels: tuple[tuple[int, int], ...] = ((4, 8), (8, 16))
    batch_sizes: tuple[int, ...] = (32, 128)

    def __post_init__(self) -> None:
        tasks = _names(self.channels, "channels", lambda v, n: DigitsConvTask(v))  # checks each pair
        object.__setattr__(self, "channels", tuple(tuple(c) for c in tasks))
        object.__setattr__(self, "batch_sizes", positive_ints(self.batch_sizes, "batch_sizes"))

    def tasks(self) -> tuple[Task, ...]:
        return tuple(DigitsConvTask(c, b) for c in self.channels for b in self.batch_sizes)


class MixtureFamily(TaskFamily):
    """Samples one of ``families`` (with probabilities ``weights``, uniform by default), then a task
    structure from it: the meta-training distribution of several kinds of problems."""

    def __init__(self, families: Any, weights: Any = None) -> None:
        if isinstance(families, TaskFamily) or not isinstance(families, (tuple, list)) or not families:
            raise ValueError(f"families must be a non-empty tuple of TaskFamily, got {families!r}")
        self.families = tuple(as_task_family(f, f"families[{i}]") for i, f in enumerate(families))
        weights = np.ones(len(families)) if weights is None else np.asarray(weights, np.float64)
        if weights.shape != (len(families),) or not np.all(np.isfinite(weights)) or np.any(weights < 0) \
                or weights.sum() <= 0:
            raise ValueError(f"weights must be {len(families)} non-negative finite numbers with a positive sum, "
                             f"got {weights!r}")
        self.weights = tuple(float(w) for w in weights / weights.sum())

    def __repr__(self) -> str:
        return f"MixtureFamily({list(self.families)!r}, weights={list(self.weights)!r})"

    def tasks(self) -> tuple[Task, ...]:
        return tuple(dict.fromkeys(t for f in self.families for t in f.tasks()))

    def sample(self, rng: np.random.Generator) -> Task:
        return self.families[int(rng.choice(len(self.families), p=self.weights))].sample(rng)


# --------------------------------------------------------------- what the shipped optimizer saw
def meta_training_family() -> MixtureFamily:
    """The meta-training distribution of the shipped optimizer (``train_pretrained``): MLPs and
    linear models on digits, iris and wine (depth 0-2, width 16/64, relu/tanh, batch 32/128) and
    least squares of condition 1-100. Autoencoders, convnets, the breast-cancer and diabetes data
    sets, depth 3, gelu/elu, batch 16 and condition 1000 are left out: :func:`held_out_problems`."""
    return MixtureFamily([MLPFamily(("digits", "iris", "wine"), (16, 64), (0, 1, 2), ("relu", "tanh"), (32, 128)),
                          LinearRegressionFamily((8, 32), (1.0, 10.0, 100.0), (16, 64))], weights=[3.0, 1.0])


def held_out_problems() -> dict[str, Task]:
    """Problems from families :func:`meta_training_family` never samples (fixed before the shipped
    optimizer was evaluated on them): the "out of distribution" set of ``train_pretrained``."""
    return {
        "breast-cancer MLP 32 relu": MLPTask("breast_cancer", (32,), "relu", 64),
        "diabetes regression MLP 32-32 tanh": MLPTask("diabetes", (32, 32), "tanh", 64),
        "wine MLP 64x3 gelu, batch 32": MLPTask("wine", (64, 64, 64), "gelu", 32),
        "digits MLP 128 elu, batch 16": MLPTask("digits", (128,), "elu", 16),
        "digits autoencoder 32-8-32 tanh": AutoencoderTask("digits", (32, 8, 32), "tanh", 64),
        "breast-cancer autoencoder 16-4-16 relu": AutoencoderTask("breast_cancer", (16, 4, 16), "relu", 32),
        "digits convnet 8-16": DigitsConvTask((8, 16), 64),
        "least squares dim 64, condition 1000": LinearRegressionTask(64, 1000.0, 32),
    }


def evaluation_problems() -> dict[str, Task]:
    """The evaluation protocol's held-out set (issue 30, fixed before any further meta-training):
    :func:`held_out_problems` and five problems of kinds :func:`meta_training_family` never samples:
    a deep linear network, a low-rank matrix completion, a wine autoencoder, a small wine classifier
    (width 8, elu, batch 16) and a linear least-squares fit of the diabetes data."""
    return {
        **held_out_problems(),
        "deep linear net 16x4": DeepLinearTask(16, 4, 32),
        "matrix completion 32x32 rank 3": MatrixCompletionTask(32, 32, 3, 0.3, 64),
        "wine autoencoder 8-3-8 elu": AutoencoderTask("wine", (8, 3, 8), "elu", 32),
        "wine MLP 8 elu, batch 16": MLPTask("wine", (8,), "elu", 16),
        "diabetes least squares (linear)": MLPTask("diabetes", (), "relu", 32),
    }


def wide_meta_training_family() -> TaskFamily:
    """A wider meta-training distribution (issue 30) that still avoids every family of
    :func:`evaluation_problems`: :func:`meta_training_family` plus quadratics, depth 3 and
    widths 8-128, batch 16-128, half of the structures under parameter rescaling (:class:`RescaledFamily`)."""
    return RescaledFamily(MixtureFamily([
        MLPFamily(("digits", "iris", "wine"), (8, 16, 64), (0, 1, 2), ("relu", "tanh"), (32, 128)),
        LinearRegressionFamily((8, 32), (1.0, 10.0, 100.0), (16, 64)),
        QuadraticFamily(dims=(4, 16, 64)),
    ], weights=[3.0, 1.0, 0.5]), max_scale=10.0, probability=0.5)


def validation_problems() -> dict[str, Task]:
    """Checkpoint selection and early stopping (issue 30): problems neither meta-trained on
    (:func:`wide_meta_training_family`) nor in the test set (:func:`evaluation_problems`)."""
    return {"least squares dim 16, condition 300, batch 8": LinearRegressionTask(16, 300.0, 8),
            "iris MLP 48 elu, batch 24": MLPTask("iris", (48,), "elu", 24)}
