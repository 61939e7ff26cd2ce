"""Tokenizers: the shipped sentencepiece vocabulary round-trips every text and was trained on corpus
version 2's training split alone; training is deterministic and never sees a held-out sentence; a
damaged vocabulary file is refused; TranslationModel takes either tokenizer."""

import base64
import gzip
import hashlib
import json

import numpy as np
import pytest

from carlskit import CorruptFileError
from carlskit._serialization import dumps_checked_json
from carlskit.data import (
    ByteTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    TranslationCorpus,
    load_translation_corpus,
    load_vocabulary,
    train_vocabulary,
    training_sentences,
)
from carlskit.data.__main__ import main
from carlskit.moe import TranslationModel

WORDS = ("save delete change add view user group page site image document search settings account email "
         "password login logout name title date time file folder link").split()


def small_corpus(held_out_word="Zorblaxian"):
    """Training pairs from WORDS; every valid and test pair holds ``held_out_word``, nowhere in training."""
    rng = np.random.default_rng(0)
    train = [(" ".join(rng.choice(WORDS, 4)), " ".join(rng.choice(WORDS, 4)[::-1]).upper()) for _ in range(300)]
    held_out = [(f"{held_out_word} {word}", f"{held_out_word.upper()} {word}") for word in WORDS]
    return TranslationCorpus({"xx": {"train": train, "valid": held_out[:5], "test": held_out[5:]}}, ["small"])


@pytest.fixture(scope="module")
def shipped():
    return load_vocabulary()


def test_both_tokenizers_round_trip_every_text(shipped):
    texts = ["Save", "  two  spaces ", "été, 保存, Сохранить, حفظ", "emoji 🙂 and tab\t", "%(count)d items", ""]
    corpus = load_translation_corpus(version=2)
    texts += [text for lang in corpus.languages for pair in corpus.pairs[lang]["test"][:3] for text in pair]
    for tokenizer in (shipped, ByteTokenizer()):
        assert isinstance(tokenizer, Tokenizer)
        rows = tokenizer.encode(texts)
        assert all(0 <= i < tokenizer.vocab_size for row in rows for i in row)
        assert tokenizer.decode(rows) == texts
    assert 8000 <= shipped.vocab_size <= 16000
    assert shipped.encode(["🙂"])[0] != [0]  # a character outside the vocabulary is its bytes, never unknown


def test_shipped_vocabulary_was_trained_on_the_training_split_only(shipped):
    corpus = load_translation_corpus(version=2)
    sentences = training_sentences(corpus)
    assert shipped.training["split"] == "train" and shipped.training["sentences"] == len(sentences)
    assert shipped.training["sentences_sha256"] == hashlib.sha256("\n".join(sentences).encode()).hexdigest()
    test = {text for lang in corpus.pairs for pair in corpus.pairs[lang]["test"] for text in pair}
    assert len(test - set(sentences)) > 1000  # the test split holds sentences the vocabulary never saw


def test_training_is_deterministic_and_sees_no_held_out_sentence(tmp_path):
    corpus = small_corpus()
    first = train_vocabulary(corpus, tmp_path / "a.json.gz", vocab_size=300)
    second = train_vocabulary(corpus, tmp_path / "b.json.gz", vocab_size=300)
    assert first.model == second.model
    assert (tmp_path / "a.json.gz").read_bytes() == (tmp_path / "b.json.gz").read_bytes()
    assert not [piece for piece in first.pieces() if "orbl" in piece.lower()]  # held-out word: bytes and letters
    assert train_vocabulary(small_corpus("Quuxite"), vocab_size=300).model == first.model  # held-out text: no effect
    assert load_vocabulary(tmp_path / "a.json.gz") == first


def test_a_damaged_vocabulary_file_is_refused(tmp_path):
    path = tmp_path / "vocab.json.gz"
    train_vocabulary(small_corpus(), path, vocab_size=300)
    document = json.loads(gzip.decompress(path.read_bytes()))
    model = bytearray(base64.b64decode(document["content"]["model"]))
    model[len(model) // 2] ^= 1
    document["content"]["model"] = base64.b64encode(bytes(model)).decode()
    path.write_bytes(gzip.compress(json.dumps(document, indent=1, sort_keys=True).encode()))
    with pytest.raises(CorruptFileError, match="SHA-256"):  # the document's checksum no longer matches
        load_vocabulary(path)
    path.write_bytes(gzip.compress(dumps_checked_json(document["content"])))  # re-sealed: the model's own sum
    with pytest.raises(CorruptFileError, match="model does not match its SHA-256"):
        load_vocabulary(path)
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(CorruptFileError, match="gzip"):
        load_vocabulary(path)
    with pytest.raises(ValueError, match="vocab_size"):
        train_vocabulary(small_corpus(), vocab_size=10)


def test_command_line_trains_a_vocabulary(tmp_path):
    from carlskit.data import build_translation_corpus

    catalog = tmp_path / "pkg" / "locale" / "fr" / "LC_MESSAGES"
    catalog.mkdir(parents=True)
    entries = "".join(f'msgid "{a} {b}"\nmsgstr "{b} {a}"\n\n' for a in WORDS for b in WORDS[:12])
    (catalog / "django.po").write_text('msgid ""\nmsgstr ""\n"Content-Type: text/plain; charset=UTF-8\\n"\n\n'
                                       + entries, encoding="utf-8")
    build_translation_corpus([tmp_path / "pkg"], tmp_path / "corpus.json.gz")
    output = tmp_path / "vocab.json.gz"
    assert main(["build", "vocabulary", str(tmp_path / "corpus.json.gz"), "--output", str(output),
                 "--vocab-size", "300"]) == 0
    assert isinstance(load_vocabulary(output), SentencePieceTokenizer)


def test_translation_model_takes_the_shared_vocabulary(shipped):
    model = TranslationModel(["fr", "2fr"], 1, 16, 2, 0, max_source_length=12, max_target_length=12,
                             tokenizer=shipped)
    assert model.pad_id == shipped.vocab_size and model.vocab_size == shipped.vocab_size + 3 + 2
    texts = ["Enregistrer les modifications", "Mot de passe"]
    source = model.encode_sources(texts, "fr")
    assert source[0, 0] == model.tag_id("fr") and source.max() < model.vocab_size
    target = model.encode_targets(texts)
    assert model.decode_ids(target) == texts and model.fits(texts[0], texts[1])
    out = model.translate(texts, "fr", batch_size=2)  # untrained: any text, decoded by the same tokenizer
    assert len(out) == 2 and all(isinstance(text, str) for text in out)
    byte_model = TranslationModel(["fr"], 1, 16, 2, 0, max_source_length=12, max_target_length=12)
    assert byte_model.tokenizer == ByteTokenizer() and byte_model.vocab_size == 256 + 3 + 1  # the default
    with pytest.raises(TypeError, match="tokenizer"):
        TranslationModel(["fr"], 1, 16, 2, tokenizer="bytes")
