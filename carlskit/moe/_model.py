"""``MoEModel``: GShard's MoE Transformer as a decoder-only language model (Flax NNX)."""

from __future__ import annotations

import functools
import math
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from carlskit._checks import boolean, choice, finite_float, instance, integer, positive_float, positive_int
from carlskit._history import History
from carlskit.moe._dispatch import DISPATCH_MODES
from carlskit.moe._gating import SECOND_EXPERT_POLICIES, experts_per_token
from carlskit.moe._layers import BATCH_AXES, FeedForward, MoEFeedForward, TransformerBlock, _dtype, _scaled_normal
from carlskit.moe._sharding import DATA_AXIS, EXPERT_AXIS, auto_axes, split

EXPERT_PARAMS = ("expert_wi", "expert_wo")


def feed_forward_for_layer(layer: int, num_layers: int, d_model: int, ffn_dim: int, num_experts: int,
                           moe_options: dict, mesh: Mesh | None, rngs: nnx.Rngs) -> nnx.Module:
    """Layer ``layer``'s FFN in a GShard stack: MoE at odd layers (or the only layer), dense elsewhere;
    with ``num_experts=0`` the MoE slots are dense FFNs of ``k * ffn_dim`` (the same per-token FLOPs)."""
    if layer % 2 == 0 and num_layers > 1:
        return FeedForward(d_model, ffn_dim, rngs=rngs)
    if num_experts == 0:
        return FeedForward(d_model, experts_per_token(moe_options["router"]) * ffn_dim, rngs=rngs)
    return MoEFeedForward(d_model, ffn_dim, num_experts, **moe_options, mesh=mesh, rngs=rngs)


def place_parameters(module: nnx.Module, mesh: Mesh) -> None:
    """Expert weights of ``module`` split over the mesh's "expert" axis (dim 0), everything else replicated."""
    state = nnx.state(module)

    def place(path: tuple[Any, ...], value: jax.Array) -> jax.Array:
        is_expert = any(str(getattr(p, "key", p)) in EXPERT_PARAMS for p in path)
        spec = PartitionSpec(EXPERT_AXIS) if is_expert else PartitionSpec()
        return jax.device_put(value, NamedSharding(mesh, spec))

    nnx.update(module, jax.tree_util.tree_map_with_path(place, state))


class MoEModel(nnx.Module):
    """Decoder-only MoE Transformer LM: every other FFN is an MoE layer (GShard 2.1, Fig. 3).

    Layers ``i`` with ``i % 2 == 1`` (or the single layer of a 1-layer model) use
    :class:`MoEFeedForward` with ``num_experts`` experts of width ``ffn_dim``; the others a dense
    FFN of width ``ffn_dim``. ``num_experts=0`` builds the dense baseline with the same per-token
    FLOPs: MoE slots become dense FFNs of width ``k * ffn_dim`` (k = 2 for top-2).

    ``loss(tokens) = next-token cross-entropy + aux_loss_weight * mean aux loss
    + z_loss_weight * mean router z-loss`` over MoE layers (the z-loss, ST-MoE eq. 5, is a
    training term as soon as ``z_loss_weight > 0``; it is always reported in the metrics).

    Variable-length rows: with ``pad_id``, tokens equal to ``pad_id`` are padding (put them at
    the end of a row: attention is causal, so real tokens never see them). Padded inputs are
    routed to no expert, take no capacity and are left out of the aux and z losses; padded
    targets are left out of the cross-entropy (a mean over real target tokens).

    ``dtype`` is the compute dtype: with ``jnp.bfloat16`` the parameters stay float32 (master
    weights, updated by the optimizer in float32) and are cast to bfloat16 on use, so
    activations, expert buffers and combine weights are bfloat16; the router's softmax, attention
    softmax, layer-norm statistics and the loss run in float32.

    Gating options (``expert_capacity``, ``second_expert_threshold``, ``gating_logit_cap``,
    ``renormalize_after_drops``) are passed to every :class:`MoEFeedForward`.

    With ``mesh`` (a ``jax.sharding.Mesh`` with axes "data" and "expert"): parameters are placed
    at construction (expert weights split over "expert", the rest replicated), the batch is split
    over all devices and the expert dispatch is an all-to-all. The same ``seed`` gives the same
    parameters with or without a mesh. In a process group (:func:`carlskit.cluster.run_spmd`), a
    mesh over ``jax.devices()`` spans every process: each builds the model with the same ``seed``
    and feeds the same global batch, the experts are split across the processes and the
    all-to-all crosses them (2 processes x 4 devices equal 1 x 8 and one device:
    ``tests/moe/test_moe_processes.py``).
    """

    def __init__(
        self,
        vocab_size: int,
        num_layers: int,
        d_model: int,
        num_heads: int,
        num_experts: int,
        *,
        capacity_factor: float = 2.0,
        aux_loss_weight: float = 1e-2,
        z_loss_weight: float = 0.0,
        second_expert_policy: str = "random",
        second_expert_threshold: float = 0.5,
        gating_logit_cap: float = 0.0,
        renormalize_after_drops: bool = False,
        expert_capacity: int | None = None,
        dtype: Any = jnp.float32,
        pad_id: int | None = None,
        router: str = "top2",
        dispatch: str = "scatter",
        ffn_dim: int | None = None,
        group_size: int | None = None,
        max_length: int = 256,
        mesh: Mesh | None = None,
        seed: int = 0,
    ):
        for name, value in (("vocab_size", vocab_size), ("num_layers", num_layers), ("d_model", d_model),
                            ("num_heads", num_heads), ("max_length", max_length)):
            positive_int(value, name)
        integer(num_experts, "num_experts", minimum=0)  # 0 = the dense baseline
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} must be divisible by num_heads={num_heads}")
        moe_options = _moe_options(
            router=router, capacity_factor=capacity_factor, second_expert_policy=second_expert_policy,
            dispatch=dispatch, group_size=group_size, aux_loss_weight=aux_loss_weight, z_loss_weight=z_loss_weight,
            second_expert_threshold=second_expert_threshold, gating_logit_cap=gating_logit_cap,
            renormalize_after_drops=renormalize_after_drops, expert_capacity=expert_capacity,
        )
        ffn_dim = 4 * d_model if ffn_dim is None else positive_int(ffn_dim, "ffn_dim")
        self.dtype = _dtype(dtype, "dtype")
        self.pad_id = None if pad_id is None else _pad_id(pad_id, vocab_size)
        self.mesh = None if mesh is None else _checked_mesh(mesh)
        rngs = nnx.Rngs(params=seed)
        self.vocab_size = int(vocab_size)
        self.max_length = int(max_length)
        self.num_experts = int(num_experts)
        self.aux_loss_weight = float(aux_loss_weight)
        self.z_loss_weight = float(z_loss_weight)
        self.embedding = _scaled_normal(rngs, (vocab_size, d_model), d_model)  # tied with the output
        self.position_embedding = _scaled_normal(rngs, (max_length, d_model), 2500.0)  # std 0.02
        self.blocks = nnx.List([
            TransformerBlock(d_model, num_heads, self._feed_forward(i, num_layers, d_model, ffn_dim, moe_options, rngs),
                             rngs=rngs)
            for i in range(num_layers)
        ])
        self.final_norm = nnx.LayerNorm(d_model, rngs=rngs)
        if self.mesh is not None:
            self._place_parameters()

    def _feed_forward(self, layer: int, num_layers: int, d_model: int, ffn_dim: int, moe_options: dict,
                      rngs: nnx.Rngs) -> nnx.Module:
        return feed_forward_for_layer(layer, num_layers, d_model, ffn_dim, self.num_experts, moe_options,
                                      self.mesh, rngs)

    # ----------------------------------------------------------------------------- placement
    def _place_parameters(self) -> None:
        place_parameters(self, self.mesh)

    def shard_batch(self, tokens: Any) -> jax.Array:
        """Checked int32 tokens [B, L], split over all devices of the mesh (if any)."""
        if not isinstance(tokens, jax.Array):
            tokens = self._check_tokens(np.asarray(tokens), "tokens")  # host data: value check costs no sync
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"tokens must be an int array [batch, length], got {tokens.dtype} {tokens.shape}")
        if tokens.shape[1] < 2:
            raise ValueError(f"tokens must have length >= 2 (inputs and next-token targets), got {tokens.shape}")
        if tokens.shape[1] > self.max_length + 1:
            raise ValueError(f"tokens length {tokens.shape[1]} exceeds max_length + 1 = {self.max_length + 1}")
        tokens = tokens.astype(np.int32)  # host data is cast on the host
        if self.mesh is not None and tokens.shape[0] % self.mesh.size:
            raise ValueError(f"batch {tokens.shape[0]} must be divisible by the mesh size {self.mesh.size}")
        # Host data in by one explicit transfer, straight to its devices (jnp.asarray would be an
        # implicit one, and a second copy with a mesh); a device array stays where it is without a mesh.
        sharding = None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec(BATCH_AXES))
        return jax.device_put(tokens, sharding)

    def _check_tokens(self, data: np.ndarray, name: str, *, min_length: int = 2) -> np.ndarray:
        """Host-side check of token ids [N, L]: integer dtype, 0 <= id < vocab_size.

        Out-of-range ids would otherwise read NaN embeddings (``jnp.take`` fills) and silently
        turn the loss, and after one step every parameter, into NaN.
        """
        if data.ndim != 2 or data.shape[1] < min_length or not np.issubdtype(data.dtype, np.integer):
            raise ValueError(
                f"{name} must be an int array [rows, length >= {min_length}], got {data.dtype} {data.shape}"
            )
        if data.size and (data.min() < 0 or data.max() >= self.vocab_size):
            raise ValueError(
                f"{name} holds token ids in [{data.min()}, {data.max()}], outside [0, vocab_size={self.vocab_size})"
            )
        return data

    # ----------------------------------------------------------------------------- forward
    def __call__(self, tokens: jax.Array, *, rng: jax.Array | None = None) -> tuple[jax.Array, list]:
        """float32 logits [B, L, vocab] and the routings of the MoE layers (computed in ``dtype``)."""
        if self.dtype is jnp.float32:
            return self._forward(tokens, rng)
        # Mixed precision: a bfloat16 copy of the float32 parameters for this forward pass; the
        # cast is differentiable, so gradients arrive in float32 on the master weights.
        graphdef, state = nnx.split(self)
        low = jax.tree.map(lambda v: v.astype(self.dtype) if jnp.issubdtype(v.dtype, jnp.floating) else v, state)
        return nnx.merge(graphdef, low)._forward(tokens, rng)

    def paddings(self, tokens: jax.Array) -> jax.Array | None:
        """[B, L] 1 where ``tokens == pad_id`` (None without ``pad_id``)."""
        return None if self.pad_id is None else (tokens == self.pad_id).astype(jnp.int32)

    def _forward(self, tokens: jax.Array, rng: jax.Array | None) -> tuple[jax.Array, list]:
        length = tokens.shape[1]
        embedding = self.embedding[...]
        paddings = self.paddings(tokens)
        # math.sqrt (a Python float) keeps bfloat16 activations bfloat16; np.sqrt would promote them.
        x = jnp.take(embedding, tokens, axis=0) * math.sqrt(embedding.shape[1]) + self.position_embedding[...][:length]
        x = split(x, 0, BATCH_AXES, mesh=self.mesh)
        routings = []
        for i, block in enumerate(self.blocks):
            layer_rng = None if rng is None else jax.random.fold_in(rng, i)
            x, routing = block(x, rng=layer_rng, paddings=paddings)
            if routing is not None:
                routings.append(routing)
        logits = (self.final_norm(x) @ embedding.T).astype(jnp.float32)
        return split(logits, 0, BATCH_AXES, mesh=self.mesh), routings

    def loss_and_metrics(self, tokens: jax.Array, *, rng: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """Training loss and metrics (cross_entropy, aux_loss, router_z_loss, drop fractions,
        expert_load [num_moe_layers, E], target_tokens) for int tokens [B, L]."""
        logits, routings = self(tokens[:, :-1], rng=rng)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
        if self.pad_id is None:
            target_tokens = jnp.asarray(losses.size, jnp.float32)
            cross_entropy = jnp.mean(losses)
        else:  # mean over real targets only
            real = (tokens[:, 1:] != self.pad_id).astype(jnp.float32)
            target_tokens = jnp.sum(real)
            cross_entropy = jnp.sum(losses * real) / jnp.maximum(target_tokens, 1.0)
        metrics: dict[str, jax.Array] = {"cross_entropy": cross_entropy, "target_tokens": target_tokens}
        loss = cross_entropy
        if routings:
            aux = jnp.mean(jnp.stack([r.aux_loss for r in routings]))
            z_loss = jnp.mean(jnp.stack([r.metrics["router_z_loss"] for r in routings]))
            loss = loss + self.aux_loss_weight * aux + self.z_loss_weight * z_loss
            metrics.update(aux_loss=aux, router_z_loss=z_loss)
            for key in ("dropped_first", "dropped_second", "dropped_tokens"):
                metrics[key] = jnp.mean(jnp.stack([r.metrics[key] for r in routings]))
            metrics["expert_load"] = jnp.stack([r.metrics["expert_load"] for r in routings])
        metrics["loss"] = loss
        return loss, metrics

    def loss(self, tokens: jax.Array, *, rng: jax.Array | None = None) -> jax.Array:
        """Next-token cross-entropy plus the weighted aux (and z) losses, for int32 tokens [B, L]."""
        return self.loss_and_metrics(tokens, rng=rng)[0]

    # ----------------------------------------------------------------------------- training
    def fit(
        self,
        tokens: Any,
        *,
        steps: int,
        batch_size: int = 16,
        learning_rate: float = 3e-3,
        optimizer: optax.GradientTransformation | None = None,
        seed: int = 0,
        eval_tokens: Any | None = None,
        eval_every: int = 0,
        callback: Callable[[int, dict], None] | None = None,
    ) -> History:
        """Train on rows of ``tokens`` [N, L] (random batches of ``batch_size``) with optax
        (default Adam with ``learning_rate``); parameters are updated in place.

        Returns the history (:class:`carlskit.History`): one record per step with ``step`` (1 for
        the first), ``loss``, ``cross_entropy``, ``aux_loss``, drop fractions, ``expert_load``
        ([MoE layers, E]), ``seconds`` (training wall time since the start, evaluations excluded);
        ``eval_loss`` (validation cross-entropy, nats) every ``eval_every`` steps (if ``eval_tokens``).
        ``callback(step, record)`` is called after each step (``step`` counting from 0).

        The loop is a :class:`carlskit.training.Trainer`'s, with the same step, and three
        differences the model needs: no finiteness check (fit trains on, as optax does, and the
        check is one more reduction per step), ``expert_load`` kept as an array metric, and the
        parameters' placement on the model's mesh kept (the Trainer would replicate them).
        """
        from carlskit.training import Trainer  # training imports the bank and Dask: only when fitting

        # Every argument is checked before the first step, so a bad one never leaves a half-trained model.
        data, evaluate = self._check_fit(tokens, steps, batch_size, learning_rate, optimizer, eval_tokens, eval_every)
        batch_size, steps = int(batch_size), int(steps)
        if callback is not None and not callable(callback):
            raise TypeError(f"callback must be callable as callback(step, record), got {type(callback).__name__}")
        if steps == 0:
            return History()
        # The rows of every step, drawn up front as the loop used to draw them one step at a time:
        # a batch is then a function of its step, whatever the Trainer's pipeline prefetches.
        rows = np.random.default_rng(seed).integers(0, len(data), (steps, batch_size))
        routing_key_at = step_routing_keys(seed, self.mesh)

        def batch_at(step: int) -> dict:
            return {"tokens": self.shard_batch(data[rows[step]]), "rng": routing_key_at(step)}

        trainer = Trainer(self, optimizer or optax.adam(learning_rate), _tokens_loss, check_finite=False,
                          array_metrics=True)
        started = [time.perf_counter()]  # moved forward by each evaluation: "seconds" counts training only
        chunk = eval_every if evaluate else steps

        def on_record(record: dict) -> None:
            record["seconds"] = time.perf_counter() - started[0]
            evaluated_next = evaluate and (record["step"] % chunk == 0 or record["step"] == steps)
            if callback is not None and not evaluated_next:  # an evaluated step's callback sees eval_loss
                callback(record["step"] - 1, record)

        while trainer.step < steps:
            trainer.fit(batch_at, min(chunk, steps - trainer.step), progress=False, live=False, callback=on_record)
            if evaluate:
                evaluation_started = time.perf_counter()
                record = trainer.history[-1]
                record["eval_loss"] = self.evaluate(eval_tokens, batch_size=batch_size)["cross_entropy"]
                started[0] += time.perf_counter() - evaluation_started
                if callback is not None:
                    callback(record["step"] - 1, record)
        return trainer.history

    def _check_fit(self, tokens: Any, steps: Any, batch_size: Any, learning_rate: Any, optimizer: Any,
                   eval_tokens: Any, eval_every: Any) -> tuple[np.ndarray, bool]:
        """``fit``'s arguments checked; the training rows and whether to evaluate."""
        batch_size = positive_int(batch_size, "batch_size")
        integer(steps, "steps", minimum=0)
        integer(eval_every, "eval_every", minimum=0)  # 0 = never
        if optimizer is None:
            positive_float(learning_rate, "learning_rate")
        data = self._check_tokens(np.asarray(tokens), "tokens")
        if data.shape[0] < batch_size:
            raise ValueError(f"tokens must hold at least batch_size={batch_size} rows, got {data.shape}")
        if data.shape[1] > self.max_length + 1:
            raise ValueError(f"tokens length {data.shape[1]} exceeds max_length + 1 = {self.max_length + 1}")
        if eval_tokens is None or not eval_every:
            return data, False
        evaluation = self._check_tokens(np.asarray(eval_tokens), "eval_tokens")
        if evaluation.shape[0] < batch_size or evaluation.shape[1] > self.max_length + 1:
            raise ValueError(
                f"eval_tokens must be [rows >= batch_size={batch_size}, length <= {self.max_length + 1}], "
                f"got {evaluation.shape}"
            )
        return data, True

    def evaluate(self, tokens: Any, *, batch_size: int | None = None) -> dict[str, float]:
        """Mean metrics over all rows of ``tokens`` [N, L] (routing with the fixed evaluation key):
        ``cross_entropy`` (nats per real target token), ``bits_per_token`` (the same in bits: bits
        per byte for a byte-level model), ``perplexity``, ``aux_loss``, drop fractions,
        ``target_tokens``.

        Rows are run in batches of ``batch_size`` (default all); a last, smaller batch holds the
        remainder, and each batch's metrics are weighted by its rows.
        """
        data = self._check_tokens(np.asarray(tokens), "tokens")
        if batch_size is not None:
            batch_size = positive_int(batch_size, "batch_size")
        batch_size = batch_size or len(data)
        if batch_size < 1 or len(data) < batch_size:
            raise ValueError(f"tokens must hold at least batch_size={batch_size} >= 1 rows, got {data.shape}")
        remainder = len(data) % batch_size
        if self.mesh is not None and remainder % self.mesh.size:
            raise ValueError(
                f"tokens rows {len(data)} leave a last batch of {remainder} rows, not divisible by the mesh "
                f"size {self.mesh.size}; pass a batch_size that divides the rows"
            )
        graphdef, state = nnx.split(self)
        totals: dict[str, float] = {}
        targets = 0.0
        for start in range(0, len(data), batch_size):
            rows = data[start : start + batch_size]
            _, metrics = _eval_step(graphdef, state, self.shard_batch(rows))
            batch_targets = float(metrics.pop("target_tokens"))
            targets += batch_targets
            # cross-entropy is a mean over (real) target tokens: weight it by them; the rest by rows
            for key, value in metrics.items():
                if np.ndim(value) == 0:
                    weight = batch_targets if key == "cross_entropy" else len(rows)
                    totals[key] = totals.get(key, 0.0) + float(value) * weight
        result = {key: value / (targets if key == "cross_entropy" else len(data)) for key, value in totals.items()}
        result["target_tokens"] = targets
        result["perplexity"] = float(np.exp(result["cross_entropy"]))
        result["bits_per_token"] = result["cross_entropy"] / math.log(2.0)
        return result

    def generate(
        self,
        prompt: Any,
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        rng: jax.Array | None = None,
    ) -> np.ndarray:
        """Continue int prompts [B, P] by ``max_new_tokens`` tokens (greedy when temperature is 0,
        else sampling from softmax(logits / temperature)). Returns [B, P + max_new_tokens].

        Note: capacity-limited routing groups whole sequences, so padding after the current
        position can take second-choice slots; generation is approximate for tight capacity.
        """
        prompt = self._check_tokens(np.asarray(prompt), "prompt", min_length=1)
        integer(max_new_tokens, "max_new_tokens", minimum=0)
        finite_float(temperature, "temperature", minimum=0.0)  # 0 = greedy
        total = prompt.shape[1] + max_new_tokens
        if total > self.max_length:
            raise ValueError(f"prompt + max_new_tokens = {total} exceeds max_length={self.max_length}")
        buffer = np.zeros((prompt.shape[0], total), np.int32)
        buffer[:, : prompt.shape[1]] = prompt
        graphdef, state = nnx.split(self)
        rng = jax.random.key(0) if rng is None else rng
        out = _generate(graphdef, state, jnp.asarray(buffer), prompt.shape[1], float(temperature), rng)
        return np.asarray(out)


def _moe_options(*, router: Any, capacity_factor: Any, second_expert_policy: Any, dispatch: Any,
                 group_size: Any, aux_loss_weight: Any, z_loss_weight: Any, second_expert_threshold: Any,
                 gating_logit_cap: Any, renormalize_after_drops: Any, expert_capacity: Any) -> dict:
    """The keywords every :class:`MoEFeedForward` of the model gets, checked (even when unused, with
    ``num_experts=0``, so a typo never passes silently); the loss weights are checked here too."""
    experts_per_token(router)
    positive_float(capacity_factor, "capacity_factor")
    choice(second_expert_policy, "second_expert_policy", SECOND_EXPERT_POLICIES)
    choice(dispatch, "dispatch", DISPATCH_MODES)
    if group_size is not None:
        positive_int(group_size, "group_size")
    for name, value in (("aux_loss_weight", aux_loss_weight), ("z_loss_weight", z_loss_weight)):
        finite_float(value, name, minimum=0.0)
    positive_float(second_expert_threshold, "second_expert_threshold")
    finite_float(gating_logit_cap, "gating_logit_cap", minimum=0.0)
    if expert_capacity is not None:
        positive_int(expert_capacity, "expert_capacity")
    boolean(renormalize_after_drops, "renormalize_after_drops")
    return dict(capacity_factor=capacity_factor, router=router, second_expert_policy=second_expert_policy,
                dispatch=dispatch, group_size=group_size, second_expert_threshold=second_expert_threshold,
                gating_logit_cap=gating_logit_cap, renormalize_after_drops=renormalize_after_drops,
                expert_capacity=expert_capacity)


def _pad_id(pad_id: Any, vocab_size: int) -> int:
    pad_id = integer(pad_id, "pad_id", 0)
    if pad_id >= vocab_size:
        raise ValueError(f"pad_id must be < vocab_size={vocab_size}, got {pad_id}")
    return pad_id


def _checked_mesh(mesh: Any) -> Mesh:
    """``mesh`` with axes "data" and "expert" (TypeError for another type, ValueError for other axes),
    its axes made Auto (see :func:`carlskit.moe.auto_axes`)."""
    instance(mesh, "mesh", Mesh, f'a jax.sharding.Mesh with axes "{DATA_AXIS}" and "{EXPERT_AXIS}"')
    if not {DATA_AXIS, EXPERT_AXIS} <= set(mesh.axis_names):
        raise ValueError(f'mesh must be a jax.sharding.Mesh with axes "{DATA_AXIS}" and "{EXPERT_AXIS}", got {mesh!r}')
    return auto_axes(mesh)


def _loss_fn(graphdef: nnx.GraphDef, state: nnx.State, tokens: jax.Array, rng: jax.Array | None = None):
    return nnx.merge(graphdef, state).loss_and_metrics(tokens, rng=rng)


def step_routing_keys(seed: int, mesh: Mesh | None) -> Callable[[int], jax.Array]:
    """``key_at(step)``: training step ``step``'s routing key, ``fold_in(key(seed), step)``, as raw
    key data replicated over ``mesh`` (the losses wrap it back), made without implicit transfers."""
    replicated = None if mesh is None else NamedSharding(mesh, PartitionSpec())
    # where the step uses it, no copy per step; from host data, which a mesh spanning several processes
    # accepts (a device array of this process cannot be put on another process's devices)
    key = jax.random.wrap_key_data(jax.device_put(np.asarray(jax.random.key_data(jax.random.key(seed))), replicated))

    def key_at(step: int) -> jax.Array:
        # The step goes in explicitly (fold_in would transfer the Python int implicitly), and the key
        # leaves as raw data: a typed key handed to a jitted function on a mesh of several devices is
        # copied device to device at every call (JAX 0.10 finds its P() unequal to its data's P(None)).
        return jax.random.key_data(jax.random.fold_in(key, jax.device_put(np.uint32(step), replicated)))

    return key_at


def _tokens_loss(model: MoEModel, batch: dict) -> tuple[jax.Array, dict]:
    """The training step's loss: ``batch`` holds the ``tokens`` and the step's routing ``rng`` (raw key data)."""
    return model.loss_and_metrics(batch["tokens"], rng=jax.random.wrap_key_data(batch["rng"]))


_eval_step = jax.jit(_loss_fn, static_argnames=("graphdef",))


@functools.partial(jax.jit, static_argnames=("graphdef", "start", "temperature"))
def _generate(graphdef, state, buffer, start, temperature, rng):
    model = nnx.merge(graphdef, state)

    def step(position, carry):
        buffer, rng = carry
        rng, sample_key = jax.random.split(rng)
        logits = jax.lax.dynamic_index_in_dim(model(buffer)[0], position - 1, axis=1, keepdims=False)
        if temperature > 0:
            token = jax.random.categorical(sample_key, logits / temperature, axis=-1)
        else:
            token = jnp.argmax(logits, axis=-1)
        return buffer.at[:, position].set(token.astype(buffer.dtype)), rng

    buffer, _ = jax.lax.fori_loop(start, buffer.shape[1], step, (buffer, rng))
    return buffer
