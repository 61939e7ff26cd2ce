"""TranslationModel.save / load / pretrained: one sealed .npz (no pickle) gives back the same model,
tokenizer included; a missing or damaged file is refused with an error naming it."""

import jax
import numpy as np
import pytest
from flax import nnx

import carlskit.moe._translation as translation
from carlskit import CorruptFileError
from carlskit.data import ByteTokenizer, load_vocabulary
from carlskit.moe import TranslationModel


def small_model(tokenizer=None, seed=3):
    return TranslationModel(["fr", "2fr"], 2, 16, 2, 4, ffn_dim=16, max_source_length=10, max_target_length=10,
                            capacity_factor=1.5, dropout_rate=0.0, seed=seed, tokenizer=tokenizer)


def same_parameters(a, b):
    left, right = jax.tree.leaves(nnx.state(a, nnx.Param)), jax.tree.leaves(nnx.state(b, nnx.Param))
    return len(left) == len(right) and all(np.array_equal(x, y) for x, y in zip(left, right))


@pytest.mark.parametrize("tokenizer", ["bytes", "sentencepiece"])
def test_a_saved_model_loads_with_the_same_parameters_config_tokenizer_and_outputs(tmp_path, tokenizer):
    model = small_model(load_vocabulary() if tokenizer == "sentencepiece" else None)
    file = model.save(tmp_path / "model", info={"steps": 0, "bleu": {"fr": 1.5}})
    assert file == tmp_path / "model.npz" and not list(tmp_path.glob(".tmp-*"))  # atomic: no temporary left
    loaded = TranslationModel.load(file)
    assert loaded.config == model.config and loaded.tokenizer == model.tokenizer
    assert loaded.info == {"steps": 0, "bleu": {"fr": 1.5}} and model.info == {}
    assert same_parameters(loaded, model) and not same_parameters(small_model(model.tokenizer, seed=4), model)
    source = model.encode_sources(["la maison", "bonjour"], "fr")
    target = model.encode_targets(["the house", "hello"])
    np.testing.assert_array_equal(loaded.teacher_forced(source, target)[0], model.teacher_forced(source, target)[0])
    assert TranslationModel.pretrained(file).config == model.config


def test_every_damaged_byte_and_a_missing_file_are_refused_naming_the_file(tmp_path):
    file = small_model().save(tmp_path / "model.npz")
    data = file.read_bytes()
    for position in (100, len(data) // 2, len(data) - 70, len(data) - 1):
        damaged = tmp_path / f"damaged{position}.npz"
        damaged.write_bytes(data[:position] + bytes([data[position] ^ 1]) + data[position + 1:])
        with pytest.raises(CorruptFileError, match=damaged.name):
            TranslationModel.load(damaged)
    unsealed = tmp_path / "unsealed.npz"
    np.savez(unsealed, description=np.zeros(3, np.uint8))
    with pytest.raises(CorruptFileError, match="seal"):
        TranslationModel.load(unsealed)
    with pytest.raises(FileNotFoundError, match="absent.npz"):
        TranslationModel.load(tmp_path / "absent.npz")


def test_pretrained_names_the_shipped_file_when_it_is_absent(monkeypatch):
    monkeypatch.setattr(translation, "PRETRAINED_FILE", "no_such_model.npz")
    with pytest.raises(FileNotFoundError, match="no_such_model.npz"):
        TranslationModel.pretrained()


def test_save_refuses_info_json_cannot_hold_and_a_tokenizer_it_cannot_write(tmp_path):
    model = small_model()
    with pytest.raises(ValueError, match="info"):
        model.save(tmp_path / "m", info={"bleu": float("nan")})
    assert not (tmp_path / "m.npz").exists()

    class Custom(ByteTokenizer):
        pass

    model.tokenizer = Custom()
    with pytest.raises(TypeError, match="Custom"):
        model.save(tmp_path / "m")
