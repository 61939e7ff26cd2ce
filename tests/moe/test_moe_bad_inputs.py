"""Bad arguments to the MoE API raise a ValueError naming them, before any state changes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from carlskit.moe import (
    MoEFeedForward,
    MoEModel,
    expert_capacity,
    expert_choice_gating,
    make_mesh,
    top1_gating,
    top2_gating,
    toy_multilingual_corpus,
)

VOCAB, LENGTH = 16, 8


def tiny(**kwargs):
    config = dict(vocab_size=VOCAB, num_layers=2, d_model=8, num_heads=2, num_experts=2, max_length=LENGTH)
    config.update(kwargs)
    return MoEModel(**config)


def parameters(model):
    return [np.asarray(leaf) for leaf in jax.tree.leaves(nnx.state(model))]


def test_out_of_vocabulary_tokens_raise_and_leave_the_model_unchanged():
    # Before: ids >= vocab_size read NaN embeddings; fit returned loss NaN and left every parameter NaN.
    model = tiny()
    before = parameters(model)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (4, LENGTH + 1))
    for bad in (tokens + VOCAB, tokens - VOCAB):
        with pytest.raises(ValueError, match="vocab_size"):
            model.fit(bad, steps=1, batch_size=2)
        with pytest.raises(ValueError, match="vocab_size"):
            model.evaluate(bad)
        with pytest.raises(ValueError, match="eval_tokens"):
            model.fit(tokens, steps=1, batch_size=2, eval_tokens=bad, eval_every=1)
    with pytest.raises(ValueError, match="prompt"):
        model.generate(np.array([[VOCAB]]), 2)
    for after, expected in zip(parameters(model), before):
        np.testing.assert_array_equal(after, expected)


@pytest.mark.parametrize(
    "kwargs, name, error",
    [
        (dict(batch_size=0), "batch_size", ValueError),
        (dict(steps=1.5), "steps", TypeError),
        (dict(learning_rate=float("nan")), "learning_rate", ValueError),
        (dict(eval_every=-1), "eval_every", ValueError),
    ],
)
def test_fit_checks_arguments_before_training(kwargs, name, error):
    model = tiny()
    before = parameters(model)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (4, LENGTH + 1))
    with pytest.raises(error, match=name):  # TypeError for a wrong type, ValueError for a bad value
        model.fit(tokens, **{"steps": 1, "batch_size": 2, **kwargs})
    for after, expected in zip(parameters(model), before):
        np.testing.assert_array_equal(after, expected)


def test_generate_and_evaluate_check_arguments():
    model = tiny()
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(np.array([[1, 2]]), -1)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(np.array([[1, 2]]), 2, temperature=-1.0)
    with pytest.raises(ValueError, match="prompt"):  # float ids were silently truncated
        model.generate(np.array([[1.5, 2.0]]), 2)
    tokens = np.zeros((4, LENGTH + 1), np.int32)
    with pytest.raises(ValueError, match="batch_size"):  # 0 silently meant "all rows"
        model.evaluate(tokens, batch_size=0)
    with pytest.raises(ValueError, match="row"):
        model.evaluate(tokens[:0])
    with pytest.raises(ValueError, match="length >= 2"):
        model.shard_batch(tokens[:, :1])


@pytest.mark.parametrize(
    "kwargs, name, error",
    [
        (dict(capacity_factor=0.0), "capacity_factor", ValueError),
        (dict(group_size=0), "group_size", ValueError),  # silently meant "one group per sequence"
        (dict(group_size=-3), "group_size", ValueError),
        (dict(ffn_dim=0), "ffn_dim", ValueError),  # silently meant 4 * d_model
        (dict(num_experts=2.5), "num_experts", TypeError),
        (dict(num_experts=0, dispatch="nope"), "dispatch", ValueError),
        (dict(num_experts=0, capacity_factor=-1.0), "capacity_factor", ValueError),
        (dict(aux_loss_weight=float("nan")), "aux_loss_weight", ValueError),
        (dict(d_model=10, num_heads=3), "num_heads", ValueError),
        (dict(vocab_size=True), "vocab_size", TypeError),
        (dict(num_experts=1), "num_experts >= 2", ValueError),  # top-2 would send each token twice to one expert
    ],
)
def test_model_constructor_rejects_bad_configuration(kwargs, name, error):
    with pytest.raises(error, match=name):  # TypeError for a wrong type, ValueError for a bad value
        tiny(**kwargs)


def test_gating_checks_static_shapes_and_capacity():
    logits = jnp.zeros((2, 4, 3))
    with pytest.raises(ValueError, match="num_experts >= 1"):
        top1_gating(jnp.zeros((2, 4, 0)), 2)
    with pytest.raises(ValueError, match="num_experts >= 2"):
        top2_gating(jnp.zeros((2, 4, 1)), 2, second_expert_policy="all")
    with pytest.raises(ValueError, match="capacity"):
        expert_choice_gating(logits, 0)
    routing = top2_gating(logits, np.int64(2), second_expert_policy="all")  # NumPy ints are fine
    assert routing.capacity == 2


@pytest.mark.parametrize(
    "args, name, error",
    [
        ((4, 2, float("inf")), "capacity_factor", ValueError),
        ((4.5, 2, 1.0), "group_size", TypeError),  # was silently accepted
        (("4", 2, 1.0), "group_size", TypeError),
        ((4, 2, "1"), "capacity_factor", TypeError),
    ],
)
def test_expert_capacity_names_bad_arguments(args, name, error):
    with pytest.raises(error, match=name):  # TypeError for a wrong type, ValueError for a bad value
        expert_capacity(*args)


def test_make_mesh_and_corpus_name_bad_arguments():
    with pytest.raises(ValueError, match="data"):
        make_mesh(0)  # was ZeroDivisionError
    with pytest.raises(TypeError, match="data"):  # a wrong type: TypeError since issue 16 (was ValueError)
        make_mesh(1.0)
    with pytest.raises(ValueError, match="expert"):
        make_mesh(1, 0)
    with pytest.raises(TypeError, match="num_sequences"):
        toy_multilingual_corpus(2.5, 4)  # was "TypeError: seed must be integer"


def test_moe_layer_rejects_bad_group_size():
    with pytest.raises(ValueError, match="group_size"):
        MoEFeedForward(8, 16, 2, group_size=0, rngs=nnx.Rngs(0))


def test_evaluate_counts_every_row():
    # Before: rows past the last full batch were silently left out of the mean.
    model = tiny(num_experts=0)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (5, LENGTH + 1))
    tokens[4] = 0  # an outlier row in the remainder
    whole = model.evaluate(tokens)["cross_entropy"]
    in_batches = model.evaluate(tokens, batch_size=2)["cross_entropy"]
    np.testing.assert_allclose(in_batches, whole, rtol=1e-5)


def test_layer_and_dispatch_check_shapes_at_trace_time():
    from carlskit.moe import combine, dispatch

    layer = MoEFeedForward(8, 16, 2, second_expert_policy="all", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="d_model=8"):
        layer(jnp.zeros((2, 4, 6)))  # was a deep einsum error
    with pytest.raises(ValueError, match="d_model=8"):
        layer(jnp.zeros((4, 8)))  # was "not enough values to unpack"
    routing = top2_gating(jnp.zeros((2, 4, 2)), 2, second_expert_policy="all")
    with pytest.raises(ValueError, match="group_size=4"):
        dispatch(routing, jnp.zeros((2, 5, 8)))
    with pytest.raises(ValueError, match="expert_out"):
        combine(routing, jnp.zeros((3, 2, 2, 8)))
    assert combine(routing, dispatch(routing, jnp.ones((2, 4, 8)))).shape == (2, 4, 8)


def test_low_level_dispatch_paths_check_shapes_too():
    from carlskit.moe import combine_einsum, combine_scatter, dispatch_einsum, dispatch_gather

    routing = top2_gating(jnp.zeros((2, 4, 2)), 2, second_expert_policy="all")
    for function in (dispatch_gather, dispatch_einsum):
        with pytest.raises(ValueError, match="group_size=4"):
            function(routing, jnp.zeros((2, 5, 8)))
    for function in (combine_scatter, combine_einsum):
        with pytest.raises(ValueError, match="expert_out"):
            function(routing, jnp.zeros((2, 2, 3, 8)))
