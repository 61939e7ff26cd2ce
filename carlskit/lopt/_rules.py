"""Pure update rules of learned optimizers: the per-parameter MLP rule and LearnableAdam.

An update rule is a frozen (hashable) dataclass, so it can be a static argument of ``jax.jit``.
It has three pure functions over plain pytrees:

* ``init_meta_params(key) -> meta_params``
* ``init_state(params) -> state``
* ``update(meta_params, state, grads, params, time_scale) -> (updates, state)``

``updates`` are added to the parameters (optax convention: ``params + updates``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from carlskit._checks import finite_float, positive_float
from carlskit.lopt._checks import check_same_layout, check_state_keys, positive_ints
from carlskit.lopt._protocols import UpdateRule

PyTree = Any

TIME_SCALES: tuple[float, ...] = (1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 1000.0, 3000.0, 10000.0)


def tanh_time_features(step: jax.Array) -> jax.Array:
    """Time embedding ``tanh(t / s - 1)`` for s in ``TIME_SCALES`` (Metz et al. 2020, App. C; MLPLOpt)."""
    step = jnp.asarray(step, jnp.float32)
    return jnp.tanh(step / jnp.asarray(TIME_SCALES, jnp.float32) - 1.0)


def second_moment_normalize(features: jax.Array, epsilon: float = 1e-5, feature_axis: int = -1) -> jax.Array:
    """``x * rsqrt(mean(x^2) + eps)`` per feature over all entries of a tensor (``feature_axis`` = feature)."""
    feature_axis = feature_axis % features.ndim
    axes = tuple(a for a in range(features.ndim) if a != feature_axis)
    return features * jax.lax.rsqrt(jnp.mean(jnp.square(features), axis=axes, keepdims=True) + epsilon)


def _decays(values: Any) -> tuple[float, ...]:
    """Momentum decays: a non-empty tuple of floats in ``[0, 1)``; ValueError naming ``decays``."""
    try:
        decays = tuple(finite_float(d, "decays") for d in values)
    except TypeError:
        decays = ()
    if not decays or any(not 0.0 <= d < 1.0 for d in decays):
        raise ValueError(f"decays must be a non-empty tuple of floats in [0, 1), got {values!r}")
    return decays


def _dense_init(key: jax.Array, fan_in: int, fan_out: int, scale: float = 1.0) -> dict[str, jax.Array]:
    weight = jax.random.normal(key, (fan_in, fan_out), jnp.float32) * (scale / math.sqrt(fan_in))
    return {"w": weight, "b": jnp.zeros((fan_out,), jnp.float32)}


@dataclasses.dataclass(frozen=True)
class MLPUpdateRule(UpdateRule):
    """Per-parameter MLP optimizer in the style of learned_optimization's ``MLPLOpt``.

    For every scalar parameter the MLP reads the gradient ``g``, the parameter ``p`` and momenta
    ``m_k = b_k m_k + (1 - b_k) g`` for each decay ``b_k``; each of these features is divided by its
    root mean square over the tensor. Time features ``tanh(t / s - 1)`` are shared by all parameters.
    The MLP (plus a linear skip path) outputs a direction ``d`` and a magnitude ``a``; the step is

        p <- p - d * exp(exp_mult * a) * step_mult        (Metz et al. 2020, Sec. 3 / App. C)

    ``initial_learning_rate`` sets the skip weight from the normalised ``b=0.9`` momentum to the
    direction so that an untrained optimizer is per-tensor-normalised momentum SGD with that step
    size (0 gives a plain random MLPLOpt). With minutes instead of CPU-years of meta-training this
    starting point matters; ES then learns the rest (schedules, use of the other features).

    Non-finite gradients: every feature is normalised by its RMS over the whole tensor, so a single
    NaN or inf gradient entry makes the update of *every* entry of that tensor NaN, and the momenta
    keep it for the following steps (optax's Adam confines it to the one entry). Other tensors are
    unaffected. Clip or guard gradients upstream (e.g. ``optax.chain(optax.zero_nans(), tx)``) when
    they can be non-finite.
    """

    hidden_sizes: tuple[int, ...] = (32, 32)
    decays: tuple[float, ...] = (0.1, 0.5, 0.9, 0.99, 0.999)
    step_mult: float = 1e-3
    exp_mult: float = 1e-3
    initial_learning_rate: float = 1e-2
    kind: ClassVar[str] = "mlp"

    def __post_init__(self) -> None:
        object.__setattr__(self, "hidden_sizes", positive_ints(self.hidden_sizes, "hidden_sizes"))
        object.__setattr__(self, "decays", _decays(self.decays))
        object.__setattr__(self, "step_mult", positive_float(self.step_mult, "step_mult"))
        object.__setattr__(self, "exp_mult", finite_float(self.exp_mult, "exp_mult"))
        object.__setattr__(self, "initial_learning_rate",
                           finite_float(self.initial_learning_rate, "initial_learning_rate", minimum=0.0))

    @property
    def num_param_features(self) -> int:
        return 2 + len(self.decays)

    @property
    def num_features(self) -> int:
        return self.num_param_features + len(TIME_SCALES)

    def init_meta_params(self, key: jax.Array) -> PyTree:
        """Random MLP weights (last layer scaled down) and the momentum-SGD skip path."""
        sizes = (self.num_features, *self.hidden_sizes, 2)
        keys = jax.random.split(key, len(sizes) - 1)
        layers = [
            _dense_init(k, fan_in, fan_out, scale=0.1 if i == len(sizes) - 2 else 1.0)
            for i, (k, fan_in, fan_out) in enumerate(zip(keys, sizes[:-1], sizes[1:]))
        ]
        skip = jnp.zeros((self.num_features, 2), jnp.float32)
        momentum_index = 2 + min(range(len(self.decays)), key=lambda i: abs(self.decays[i] - 0.9))
        skip = skip.at[momentum_index, 0].set(self.initial_learning_rate / self.step_mult)
        return {"layers": layers, "skip": skip}

    def init_state(self, params: PyTree) -> PyTree:
        momenta = jax.tree.map(lambda p: jnp.zeros((len(self.decays), *jnp.shape(p)), jnp.float32), params)
        return {"momenta": momenta, "step": jnp.zeros((), jnp.int32)}

    def _features(self, grad, param, momenta):
        """Features ``[2 + len(decays), n]`` of one tensor's ``n`` entries (feature-major) and its new momenta.

        Feature-major rows are contiguous, so stacking needs no interleaving and each row's
        normalisation is one reduction over a contiguous row.
        """
        grad = jnp.asarray(grad, jnp.float32)
        decays = jnp.asarray(self.decays, jnp.float32).reshape((-1,) + (1,) * grad.ndim)
        momenta = decays * momenta + (1.0 - decays) * grad
        per_param = jnp.concatenate([grad.reshape(1, -1), jnp.asarray(param, jnp.float32).reshape(1, -1),
                                     momenta.reshape(len(self.decays), -1)], axis=0)
        return second_moment_normalize(per_param, feature_axis=0), momenta

    def update(self, meta_params: PyTree, state: PyTree, grads: PyTree, params: PyTree,
               time_scale: float | jax.Array = 1.0) -> tuple[PyTree, PyTree]:
        """One optimizer step for every leaf of ``params``; returns ``(updates, new_state)``.

        Features are normalised tensor by tensor, then the entries of all tensors go through the
        MLP together, as one matmul per layer in feature-major layout ``h_{l+1} = W_l^T relu(h_l)``
        (``[width, n]``: the long axis ``n`` is the fast one, which CPU matmul kernels need; the
        entry-major layout ``[n, width]`` made the 2-wide output and skip layers the slowest ops).
        The skip path shares the first matmul (its weights are appended as 2 extra output rows).

        ``grads`` and ``state`` must match ``params`` (checked when traced: ValueError naming the
        leaf). Empty ``params`` give empty updates, as in optax.
        """
        check_update_arguments(self, state, grads, params, {"momenta": (len(self.decays),)})
        if not jax.tree.leaves(params):
            return params, {"momenta": state["momenta"], "step": state["step"] + 1}
        time_features = tanh_time_features(state["step"].astype(jnp.float32) * time_scale)
        treedef = jax.tree.structure(params)
        flat_params = treedef.flatten_up_to(params)
        pairs = [self._features(g, p, m) for g, p, m in zip(treedef.flatten_up_to(grads), flat_params,
                                                            treedef.flatten_up_to(state["momenta"]))]
        features = jnp.concatenate([f for f, _ in pairs], axis=1)  # [num_param_features, n]
        layers, skip = meta_params["layers"], meta_params["skip"]
        npf, width = self.num_param_features, layers[0]["w"].shape[1]
        first = jnp.concatenate([layers[0]["w"], skip], axis=1)  # [num_features, width + 2]
        # The time features are the same for every entry: their part of the first layer and of the
        # skip path is one shared bias vector.
        bias = time_features @ first[npf:] + jnp.concatenate([layers[0]["b"], jnp.zeros((2,), jnp.float32)])
        first_out = first[:npf].T @ features + bias[:, None]  # [width + 2, n]
        hidden, skip_out = first_out[:width], first_out[width:]
        for layer in layers[1:-1]:
            hidden = layer["w"].T @ jax.nn.relu(hidden) + layer["b"][:, None]
        last = layers[-1]
        out = last["w"].T @ jax.nn.relu(hidden)
        out = out + last["b"][:, None] + skip_out  # [2, n]: direction, magnitude
        steps = out[0] * jnp.exp(self.exp_mult * out[1]) * self.step_mult
        updates, offset = [], 0
        for p in flat_params:
            size = int(np.prod(jnp.shape(p), dtype=np.int64))
            updates.append((-steps[offset:offset + size]).reshape(jnp.shape(p)).astype(jnp.result_type(p)))
            offset += size
        momenta = treedef.unflatten([m for _, m in pairs])
        return treedef.unflatten(updates), {"momenta": momenta, "step": state["step"] + 1}


def check_update_arguments(rule: UpdateRule, state: PyTree, grads: PyTree, params: PyTree,
                           per_param_state: dict[str, tuple[int, ...]], other_state: tuple[str, ...] = ()) -> None:
    """``grads`` and every ``state[name]`` in ``per_param_state`` must have the pytree structure of
    ``params`` and its leaf shapes (with the given leading axes in front); ``state['step']`` a scalar;
    ``state`` holds exactly these keys and ``other_state`` (per-run entries, e.g. loss statistics).

    Pure Python on static shapes: under ``jit`` it runs once, when the update is traced.
    """
    check_same_layout(params, "params", grads, "grads")
    check_state_keys(state, (*per_param_state, *other_state, "step"), rule)
    for name, leading_shape in per_param_state.items():
        check_same_layout(params, "params", state[name], f"state['{name}']", leading_shape)
    if np.shape(state["step"]) != ():
        raise ValueError(f"state['step']: shape {np.shape(state['step'])}, expected a scalar ()")


def _logit(x: float) -> float:
    return math.log(x / (1.0 - x))


@dataclasses.dataclass(frozen=True)
class LearnableAdamRule(UpdateRule):
    """Adam whose hyperparameters are meta-parameters (learned_optimization's ``LearnableAdam``).

    ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g^2``, ``p <- p - lr * m_hat / (sqrt(v_hat) + eps)``
    with ``lr = exp(log_lr)``, ``b = sigmoid(logit_b)``, ``eps = exp(log_eps)`` (Kingma & Ba 2015).
    """

    initial_learning_rate: float = 1e-3
    kind: ClassVar[str] = "adam"

    def __post_init__(self) -> None:
        object.__setattr__(self, "initial_learning_rate",
                           positive_float(self.initial_learning_rate, "initial_learning_rate"))

    def init_meta_params(self, key: jax.Array | None = None) -> PyTree:
        del key
        return {
            "log_learning_rate": jnp.asarray(math.log(self.initial_learning_rate), jnp.float32),
            "logit_beta1": jnp.asarray(_logit(0.9), jnp.float32),
            "logit_beta2": jnp.asarray(_logit(0.999), jnp.float32),
            "log_epsilon": jnp.asarray(math.log(1e-8), jnp.float32),
        }

    def init_state(self, params: PyTree) -> PyTree:
        zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
        return {"mu": zeros, "nu": zeros, "step": jnp.zeros((), jnp.int32)}

    def update(self, meta_params: PyTree, state: PyTree, grads: PyTree, params: PyTree,
               time_scale: float | jax.Array = 1.0) -> tuple[PyTree, PyTree]:
        del time_scale
        check_update_arguments(self, state, grads, params, {"mu": (), "nu": ()})
        lr = jnp.exp(meta_params["log_learning_rate"])
        b1 = jax.nn.sigmoid(meta_params["logit_beta1"])
        b2 = jax.nn.sigmoid(meta_params["logit_beta2"])
        eps = jnp.exp(meta_params["log_epsilon"])
        step = state["step"] + 1
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * jnp.asarray(g, jnp.float32), state["mu"], grads)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * jnp.square(jnp.asarray(g, jnp.float32)), state["nu"], grads)
        t = step.astype(jnp.float32)
        updates = jax.tree.map(
            lambda m, v, p: (-lr * (m / (1 - b1**t)) / (jnp.sqrt(v / (1 - b2**t)) + eps)).astype(jnp.result_type(p)),
            mu, nu, params)
        return updates, {"mu": mu, "nu": nu, "step": step}


_LOG_FLOOR = 1e-12


def _log_rms(x: jax.Array) -> jax.Array:
    return 0.5 * jnp.log(jnp.mean(jnp.square(x)) + _LOG_FLOOR)


@dataclasses.dataclass(frozen=True)
class HierarchicalRule(UpdateRule):
    """A learned optimizer in two levels (after Metz et al. 2020, Sec. 3: hierarchical optimizers),
    cheap enough to replace Adam: a small MLP per *tensor* decides how every entry of it moves.

    Per entry (elementwise, a few FLOPs and one state buffer per decay, as Adam):
    ``m_k = b_k m_k + (1 - b_k) g`` for ``b_k`` in ``decays``, ``v = b2 v + (1 - b2) g^2``, both bias
    corrected, and the directions ``d = [g / (sqrt(v) + eps), m_k / (sqrt(v) + eps) ..., p / rms(p)]``.

    Per tensor: features ``[time features tanh(t / s - 1), log rms of p, g, sqrt(v) and of each
    direction, log size, is-a-vector]`` go through the MLP (one hidden layer, ``tanh``), which outputs
    a log step size ``a`` and one coefficient ``c_j`` per direction. The update is

        p <- p - initial_learning_rate * exp(a) * (d_{0.9} + sum_j c_j d_j)

    The output layer starts at zero, so the untrained rule is exactly Adam (``b1`` = the decay
    closest to 0.9, ``b2``, ``eps``) at ``initial_learning_rate``; meta-training learns schedules
    (from the time features), step sizes relative to the parameters' and gradients' scale, momentum
    mixes and weight decay. All tensors' features go through the MLP as one ``[tensors, features]``
    matmul, so the per-entry cost stays Adam's plus one buffer per extra decay (see
    ``benchmarks/lopt_step.py``).
    """

    hidden_size: int = 32
    decays: tuple[float, ...] = (0.9, 0.99)
    second_moment_decay: float = 0.999
    epsilon: float = 1e-8
    initial_learning_rate: float = 3e-3
    kind: ClassVar[str] = "hierarchical"

    def __post_init__(self) -> None:
        object.__setattr__(self, "hidden_size", positive_ints((self.hidden_size,), "hidden_size")[0])
        object.__setattr__(self, "decays", _decays(self.decays))
        decay = finite_float(self.second_moment_decay, "second_moment_decay", minimum=0.0)
        if decay >= 1.0:
            raise ValueError(f"second_moment_decay must be in [0, 1), got {decay!r}")
        object.__setattr__(self, "second_moment_decay", decay)
        object.__setattr__(self, "epsilon", positive_float(self.epsilon, "epsilon"))
        object.__setattr__(self, "initial_learning_rate",
                           positive_float(self.initial_learning_rate, "initial_learning_rate"))

    @property
    def num_directions(self) -> int:
        return len(self.decays) + 2  # g / sqrt(v), each momentum / sqrt(v), p / rms(p)

    @property
    def num_features(self) -> int:
        return len(TIME_SCALES) + 3 + (self.num_directions - 1) + 2

    @property
    def _base_direction(self) -> int:
        return 1 + min(range(len(self.decays)), key=lambda i: abs(self.decays[i] - 0.9))

    def init_meta_params(self, key: jax.Array) -> PyTree:
        """Random hidden layer, zero output layer: the untrained rule is Adam."""
        return {"hidden": _dense_init(key, self.num_features, self.hidden_size),
                "out": {"w": jnp.zeros((self.hidden_size, 1 + self.num_directions), jnp.float32),
                        "b": jnp.zeros((1 + self.num_directions,), jnp.float32)}}

    def init_state(self, params: PyTree) -> PyTree:
        zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
        momenta = jax.tree.map(lambda p: jnp.zeros((len(self.decays), *jnp.shape(p)), jnp.float32), params)
        return {"momenta": momenta, "nu": zeros, "step": jnp.zeros((), jnp.int32)}

    def update(self, meta_params: PyTree, state: PyTree, grads: PyTree, params: PyTree,
               time_scale: float | jax.Array = 1.0) -> tuple[PyTree, PyTree]:
        """One step for every leaf of ``params``; returns ``(updates, new_state)`` (optax convention)."""
        check_update_arguments(self, state, grads, params, {"momenta": (len(self.decays),), "nu": ()})
        step = state["step"] + 1
        if not jax.tree.leaves(params):
            return params, {**state, "step": step}
        t = step.astype(jnp.float32)
        decays = jnp.asarray(self.decays, jnp.float32)
        b2 = self.second_moment_decay
        treedef = jax.tree.structure(params)
        flat_params = treedef.flatten_up_to(params)
        new_momenta, new_nu, directions, features = [], [], [], []
        for g, p, m, v in zip(treedef.flatten_up_to(grads), flat_params, treedef.flatten_up_to(state["momenta"]),
                              treedef.flatten_up_to(state["nu"])):
            g, p32 = jnp.asarray(g, jnp.float32), jnp.asarray(p, jnp.float32)
            shape = (-1,) + (1,) * g.ndim
            m = decays.reshape(shape) * m + (1.0 - decays.reshape(shape)) * g
            v = b2 * v + (1.0 - b2) * jnp.square(g)
            denominator = jnp.sqrt(v / (1.0 - b2 ** t)) + self.epsilon
            m_hat = m / (1.0 - decays.reshape(shape) ** t)
            d = [g / denominator, *(m_hat[k] / denominator for k in range(len(self.decays))),
                 p32 * jax.lax.rsqrt(jnp.mean(jnp.square(p32)) + _LOG_FLOOR)]
            features.append(jnp.stack([_log_rms(p32), _log_rms(g), _log_rms(denominator),
                                       *(_log_rms(x) for x in d[:-1]), jnp.log(float(max(g.size, 1))),
                                       jnp.asarray(float(g.ndim <= 1))]))
            new_momenta.append(m)
            new_nu.append(v)
            directions.append(d)
        time_features = tanh_time_features(t * time_scale)
        per_tensor = jnp.stack(features)  # [tensors, 3 + directions - 1 + 2]
        per_tensor = jnp.concatenate([jnp.broadcast_to(time_features, (per_tensor.shape[0], time_features.size)),
                                      0.1 * per_tensor], axis=1)
        hidden = jnp.tanh(per_tensor @ meta_params["hidden"]["w"] + meta_params["hidden"]["b"])
        out = hidden @ meta_params["out"]["w"] + meta_params["out"]["b"]  # [tensors, 1 + directions]
        step_sizes = self.initial_learning_rate * jnp.exp(out[:, 0])
        updates = []
        for i, (p, d) in enumerate(zip(flat_params, directions)):
            direction = d[self._base_direction] + sum(out[i, 1 + j] * d[j] for j in range(len(d)))
            updates.append((-step_sizes[i] * direction).astype(jnp.result_type(p)))
        return treedef.unflatten(updates), {"momenta": treedef.unflatten(new_momenta),
                                            "nu": treedef.unflatten(new_nu), "step": step}
