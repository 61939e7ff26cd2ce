"""GShard's analyses of a TranslationModel: the language x expert matrix sees a router forced to
send each language to its own expert, and capacity overflow is 0 with room for every token and
exactly the tokens past C when every token wants one expert."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from carlskit.moe import ExpertAssignment, TranslationModel, capacity_overflow, expert_assignment, top2_gating

TEXTS = {"aa": ["a", "aaaa", "aaaaaaa"], "bb": ["bb", "bbbbbb"], "cc": ["c"]}


def forced_model(capacity_factor=2.0, num_layers=1):
    """A model whose encoder MoE router sends byte "a" to expert 1 and byte "b" to expert 2.

    Attention adds nothing (its output projection is 0) and positions are 0, so the MoE layer sees
    LayerNorm(embedding[token]); "a" embeds to +v and "b" to -v, the router's columns 1 and 2 are
    +v and -v (times 10): "a" scores high on expert 1 only, "b" on expert 2 only.
    """
    model = TranslationModel(["aa", "bb", "cc"], num_layers, 16, 2, 4, ffn_dim=16, max_source_length=12,
                             max_target_length=12, dropout_rate=0.0, capacity_factor=capacity_factor)
    v = jnp.asarray(np.where(np.arange(16) % 2, 1.0, -1.0), jnp.float32)  # zero mean: LayerNorm keeps it
    embedding = model.embedding[...]
    model.embedding[...] = embedding.at[ord("a")].set(v).at[ord("b")].set(-v)
    model.source_positions[...] = jnp.zeros_like(model.source_positions[...])
    for block in model.encoder:
        block.attention.out[...] = jnp.zeros_like(block.attention.out[...])
        if hasattr(block.ffn, "router_weights"):
            router = jnp.zeros_like(block.ffn.router_weights[...])
            block.ffn.router_weights[...] = router.at[:, 1].set(10 * v).at[:, 2].set(-10 * v)
    return model


def encoded(model):
    texts = [(tag, text) for tag, texts in TEXTS.items() for text in texts]
    return model.encode_sources([t for _, t in texts], [tag for tag, _ in texts])


def test_a_language_forced_to_one_expert_fills_that_experts_column():
    model = forced_model()
    assignment = expert_assignment(model, encoded(model), batch_size=4)  # 6 rows: two batches, one padded
    assert isinstance(assignment, ExpertAssignment)
    assert assignment.tags == ("aa", "bb", "cc") and assignment.layers == ("encoder 0",)
    counts = assignment.counts[0]
    # every text token counted once (the tag and the padding not): 12 a's, 8 b's, 1 c
    np.testing.assert_array_equal(assignment.tokens[0], [12, 8, 1])
    np.testing.assert_array_equal(counts[0], [0, 12, 0, 0])
    np.testing.assert_array_equal(counts[1], [0, 0, 8, 0])
    np.testing.assert_allclose(assignment.fractions[0, :2], [[0, 1, 0, 0], [0, 0, 1, 0]])
    np.testing.assert_allclose(assignment.fractions.sum(-1), 1.0)


def test_a_language_without_sources_has_a_zero_row():
    model = forced_model()
    assignment = expert_assignment(model, model.encode_sources(["aaa"], "aa"))
    np.testing.assert_array_equal(assignment.tokens[0], [3, 0, 0])
    np.testing.assert_array_equal(assignment.fractions[0, 1:], 0.0)


def test_top_expert_is_the_gates_argmax_with_room_for_every_token():
    logits = jax.random.normal(jax.random.key(3), (5, 7, 6))
    paddings = jnp.zeros((5, 7), jnp.int32).at[:, 5:].set(1)
    routing = top2_gating(logits, 7, second_expert_policy="all", paddings=paddings)
    expected = np.where(np.asarray(paddings) == 0, np.argmax(np.asarray(logits), -1), -1)
    np.testing.assert_array_equal(routing.top_expert(), expected)
    # with C = 1 the tokens that lose both slots are dispatched nowhere
    tight = top2_gating(logits, 1, second_expert_policy="all", paddings=paddings)
    dropped = np.asarray(tight.top_expert()) == -1
    assert dropped[np.asarray(paddings) == 0].mean() == pytest.approx(float(tight.metrics["dropped_tokens"]))


def test_overflow_is_zero_with_room_for_every_token():
    model = forced_model(capacity_factor=100.0, num_layers=2)  # C clipped to S
    source = encoded(model)
    rows = capacity_overflow(model, source, model.encode_targets(["x"] * len(source)))
    assert [row["layer"] for row in rows] == ["encoder 1", "decoder 1"]
    assert [row["capacity"] for row in rows] == [12, 12]
    for row in rows:
        assert row["dropped_first"] == row["dropped_second"] == row["dropped_tokens"] == 0.0


def test_overflow_counts_the_tokens_past_capacity():
    # Every token's first choice is expert 1 (the a's, and the tag, embedded as "a" here); C = 1
    # keeps one token per row: of the 3 rows' 2, 5 and 8 real tokens (tag included) 1, 4 and 7 overflow.
    model = forced_model(capacity_factor=0.01)
    model.embedding[...] = model.embedding[...].at[model.tag_id("aa")].set(model.embedding[...][ord("a")])
    source = model.encode_sources(TEXTS["aa"], "aa")
    rows = capacity_overflow(model, source, model.encode_targets(["xy"] * 3))
    encoder = rows[0]
    assert encoder["layer"] == "encoder 0" and encoder["capacity"] == 1
    assert encoder["dropped_first"] == pytest.approx((1 + 4 + 7) / 15)
    # a second choice may still find room: dropped entirely is at most the first-choice overflow
    assert 0 < encoder["dropped_tokens"] <= encoder["dropped_first"]
    roomy = forced_model(capacity_factor=100.0)  # the same router with room for everything
    roomy.embedding[...] = model.embedding[...]
    assert capacity_overflow(roomy, source, model.encode_targets(["xy"] * 3))[0]["dropped_first"] == 0.0


def test_analyses_refuse_a_dense_model_and_rows_without_tags():
    dense = TranslationModel(["aa"], 1, 8, 2, 0, max_source_length=8, max_target_length=8)
    with pytest.raises(ValueError, match="no MoE layer"):
        expert_assignment(dense, dense.encode_sources(["a"], "aa"))
    model = forced_model()
    with pytest.raises(ValueError, match="language tag"):
        expert_assignment(model, np.zeros((2, 12), np.int32))
    with pytest.raises(ValueError, match="max_source_length"):
        capacity_overflow(model, np.zeros((2, 5), np.int32), np.zeros((2, 12), np.int32))
    with pytest.raises(TypeError, match="TranslationModel"):
        expert_assignment(object(), np.zeros((2, 12), np.int32))
