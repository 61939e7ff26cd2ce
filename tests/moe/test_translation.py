"""TranslationModel: cached decoding equals uncached token for token, training translates, the
expert-parallel model on 8 simulated devices matches one device, scores come from sacrebleu."""

import textwrap

import numpy as np
import pytest
import sacrebleu
from test_sharding import run_on_8_devices  # tests/moe is on sys.path (rootdir-relative imports)

from carlskit.data import load_translation_corpus
from carlskit.moe import TranslationModel, translation_scores
from carlskit.moe._translation import EOS, PAD


@pytest.fixture(scope="module")
def pairs():
    corpus = load_translation_corpus()
    chosen = [(en, fr) for en, fr in corpus.pairs["fr"]["train"] if len(en) < 14 and len(fr.encode()) < 14]
    return chosen[:48]


def tiny_model(seed=0):
    # one layer per stack (its FFN is the MoE layer): half the compilation of two
    return TranslationModel(["fr", "2fr"], 1, 32, 2, 4, ffn_dim=32, max_source_length=16, max_target_length=16,
                            dropout_rate=0.0, seed=seed)


@pytest.fixture(scope="module")
def decoded(pairs):
    """A tiny MoE translator trained briefly on 48 short French -> English pairs; its greedy and
    beam-4 outputs with and without the cache, and an untrained twin's greedy output."""
    model, untrained = tiny_model(), tiny_model()
    source = model.encode_sources([fr for _, fr in pairs], "fr")
    target = model.encode_targets([en for en, _ in pairs])
    history = model.fit(source, target, steps=120, batch_size=48, optimizer="adam", learning_rate=1e-2)
    outputs = {(beam, cached): model.generate(source, beam_size=beam, cached=cached, batch_size=48)
               for beam in (1, 4) for cached in (True, False)}
    return history, outputs, untrained.generate(source, batch_size=48)


def test_byte_encoding_round_trips_with_tag_eos_and_padding():
    model = TranslationModel(["fr", "2fr"], 1, 8, 2, 0, max_source_length=8, max_target_length=6)
    source = model.encode_sources(["été", "abcdefghij"], ["2fr", "fr"])
    assert source[0, 0] == model.tag_id("2fr") and list(source[0, 1:6]) == list("été".encode())
    assert (source[0, 6:] == PAD).all() and len(source[1]) == 8  # cut to fit
    target = model.encode_targets(["ok", "abcdefgh"])
    assert list(target[0, :4]) == [ord("o"), ord("k"), EOS, PAD] and EOS not in target[1]
    assert model.decode_ids(target) == ["ok", "abcdef"]
    with pytest.raises(ValueError, match="lang"):
        model.encode_sources(["x"], "de")
    with pytest.raises(TypeError, match="tags"):
        TranslationModel("fr")


def test_cached_decoding_equals_uncached_token_for_token(decoded):
    _, outputs, _ = decoded
    for beam in (1, 4):
        np.testing.assert_array_equal(outputs[beam, True], outputs[beam, False])


def test_training_translates_what_an_untrained_model_cannot(decoded, pairs):
    history, outputs, untrained = decoded
    assert history[-1]["cross_entropy"] < 0.5 * history[0]["cross_entropy"]
    english = [en for en, _ in pairs]

    def score(ids):
        return translation_scores(tiny_model().decode_ids(ids), english, ["fr"] * len(english))["fr"]

    greedy, beam, baseline = score(outputs[1, True]), score(outputs[4, True]), score(untrained)
    assert greedy["chrf"] > baseline["chrf"] + 30, (greedy, baseline)
    assert beam["bleu"] >= greedy["bleu"] - 1.0, (beam, greedy)


def test_scores_are_sacrebleu_per_language():
    hypotheses = ["the cat sat", "a dog", "hello world", "bye"]
    references = ["the cat sat", "the dog", "hello world", "goodbye"]
    scores = translation_scores(hypotheses, references, ["fr", "fr", "de", "de"])
    assert scores["fr"]["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hypotheses[:2], [references[:2]]).score)
    assert scores["de"]["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hypotheses[2:], [references[2:]]).score)
    assert scores["mean"]["bleu"] == pytest.approx((scores["fr"]["bleu"] + scores["de"]["bleu"]) / 2)
    with pytest.raises(ValueError, match="equal lengths"):
        translation_scores(["a"], [], ["fr"])


MESH_SCRIPT = textwrap.dedent(
    """
    import json
    import jax, numpy as np
    from flax import nnx
    from carlskit.moe import TranslationModel, make_mesh

    assert len(jax.devices()) == 8
    rng = np.random.default_rng(0)
    source = rng.integers(0, 256, (8, 8)).astype(np.int32); source[:, 0] = 259; source[::2, 5:] = 256
    target = rng.integers(0, 256, (8, 8)).astype(np.int32); target[1::2, 6:] = 256

    def loss_and_grads(mesh):
        model = TranslationModel(["fr"], 2, 16, 2, 8, ffn_dim=16, max_source_length=8, max_target_length=8,
                                 capacity_factor=1.0, mesh=mesh, seed=1)
        graphdef, state = nnx.split(model)
        loss = lambda s, a, b: nnx.merge(graphdef, s).loss(a, b, rng=jax.random.key(3))  # dropout on
        step = jax.jit(jax.value_and_grad(loss))
        a, b = model.shard_batch(source), model.shard_batch(target)
        value, grads = step(state, a, b)
        hlo = step.lower(state, a, b).compile().as_text() if mesh is not None else ""
        return float(value), grads, hlo

    reference, reference_grads, _ = loss_and_grads(None)
    value, grads, hlo = loss_and_grads(make_mesh(2, 4))
    grad_error = max(jax.tree.leaves(jax.tree.map(
        lambda x, y: float(np.max(np.abs(np.asarray(x) - np.asarray(y)))), reference_grads, grads)))
    print(json.dumps(dict(loss=reference, loss_error=abs(value - reference), grad_error=grad_error,
                          all_to_all=hlo.count(" all-to-all("))))
    """
)


@pytest.mark.slow
def test_expert_parallel_on_8_devices_matches_one_device_and_dispatches_by_all_to_all():
    result = run_on_8_devices(MESH_SCRIPT, timeout=280)
    assert result["loss_error"] < 1e-5 * max(1.0, result["loss"]), result
    assert result["grad_error"] < 1e-4, result
    # 2 MoE layers (encoder and decoder), each dispatch + combine forward and backward
    assert result["all_to_all"] >= 4, result
