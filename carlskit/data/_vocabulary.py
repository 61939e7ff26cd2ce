"""Tokenizers for the translation corpus: UTF-8 bytes, and a shared sentencepiece vocabulary.

GShard and M4 translate with one subword vocabulary shared by every language (GShard 2.1: a 32k
wordpiece vocabulary; M4: 64k sentencepiece). :func:`train_vocabulary` trains a sentencepiece
unigram model (Kudo 2018) on the *training* split of a :class:`TranslationCorpus` only (each
distinct English sentence and each distinct translation once, sorted), so no test sentence shapes
the vocabulary, and writes it atomically as a checksummed file beside the corpus;
:func:`load_vocabulary` checks every byte before use.

Both tokenizers have one interface (:class:`Tokenizer`): ``vocab_size`` text ids ``0 ..
vocab_size - 1``, ``encode(texts)`` -> lists of ids, ``decode(rows)`` -> texts. A model adds its own
padding, begin, end and tag ids after them (:class:`carlskit.moe.TranslationModel`).

Exact round trip: the sentencepiece model is trained with no normalisation (``identity``), with
whitespace kept as it is, and with byte fallback (a character outside the vocabulary becomes its
UTF-8 bytes, never an unknown token), so ``decode(encode(text)) == text`` for every string.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import os
from pathlib import Path
from typing import Protocol, Sequence, runtime_checkable

from carlskit._errors import CorruptFileError
from carlskit._serialization import atomic_write, dumps_checked_json, filesystem
from carlskit.data._translation import TranslationCorpus, _read_checked_gzip_json

VOCABULARY_FORMAT = "carlskit.vocabulary/1"
#: Pieces in the shipped vocabulary: 8,000. Measured on corpus version 2's test split (mean tokens
#: per sentence): English 13.8 at 8k, 11.9 at 16k, 37.5 UTF-8 bytes; translations 15.2, 12.7, 42.4.
#: 16k shortens sentences by 14-16% but doubles the tied embedding and the output softmax, which
#: dominate a small model's cost on 2 CPU cores (16k x 128 = 2M multiply-adds per target token
#: against about 0.2M for a d_model 128 layer) and the size of the model shipped with it; with
#: 149k training pairs (under 1k in 58 of the 108 languages) each of 16k pieces is seen half as often,
#: and smaller vocabularies win in low-resource translation (Sennrich & Zhang 2019).
VOCABULARY_SIZE = 8000
#: The shipped vocabulary's file name, beside ``catalogs.json.gz`` in ``data/translation``.
VOCABULARY_FILE = "catalogs.vocab.json.gz"


@runtime_checkable
class Tokenizer(Protocol):
    """What a translation model needs of its tokenizer: ``vocab_size`` text ids and a batched
    ``encode`` / ``decode`` (``decode`` ignores ids at or above ``vocab_size``' end of text)."""

    vocab_size: int

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text as its list of ids, each id in ``[0, vocab_size)``."""

    def decode(self, rows: Sequence[Sequence[int]]) -> list[str]:
        """Each row of ids back to its text."""


def _texts(texts: Sequence[str]) -> list[str]:
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise TypeError(f"texts must be a sequence of str, got {type(texts).__name__}")
    return list(texts)


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255 (``vocab_size`` 256); a cut multi-byte character decodes to nothing."""

    vocab_size = 256

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in _texts(texts)]

    def decode(self, rows: Sequence[Sequence[int]]) -> list[str]:
        return [bytes(int(i) for i in row).decode("utf-8", errors="ignore") for row in rows]

    def __eq__(self, other: object) -> bool:
        return type(other) is ByteTokenizer

    def __hash__(self) -> int:
        return hash(ByteTokenizer)

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class SentencePieceTokenizer:
    """A sentencepiece model (its serialized bytes) as a :class:`Tokenizer`.

    ``sha256`` names the model (equality and hashing use it, so a model holding the tokenizer stays
    a hashable static value under ``jax.jit``); ``training`` records how it was trained
    (:func:`train_vocabulary`: vocabulary size, options, and the SHA-256 of the training sentences).
    """

    def __init__(self, model: bytes, *, training: dict | None = None):
        import sentencepiece

        if not isinstance(model, (bytes, bytearray)) or not model:
            raise TypeError(f"model must be a sentencepiece model's non-empty bytes, got {type(model).__name__}")
        self.model = bytes(model)
        self.sha256 = hashlib.sha256(self.model).hexdigest()
        self.training = dict(training or {})
        self._processor = sentencepiece.SentencePieceProcessor(model_proto=self.model)
        self.vocab_size = int(self._processor.get_piece_size())

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(row) for row in self._processor.encode(_texts(texts), out_type=int)]

    def decode(self, rows: Sequence[Sequence[int]]) -> list[str]:
        return [self._processor.decode([int(i) for i in row]) for row in rows]

    def pieces(self) -> list[str]:
        """The vocabulary's pieces by id (``▁`` marks a word start, ``<0xNN>`` a fallback byte)."""
        return [self._processor.id_to_piece(i) for i in range(self.vocab_size)]

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically: gzip of a checksummed JSON document (:func:`load_vocabulary` reads it)."""
        content = {"format": VOCABULARY_FORMAT, "kind": "sentencepiece", "vocab_size": self.vocab_size,
                   "model_sha256": self.sha256, "training": self.training,
                   "model": base64.b64encode(self.model).decode("ascii")}
        fs, name = filesystem(path)
        parent = name.rsplit("/", 1)[0] if "/" in name else ""
        if parent:
            fs.makedirs(parent, exist_ok=True)
        atomic_write(fs, name, gzip.compress(dumps_checked_json(content), mtime=0))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SentencePieceTokenizer) and other.sha256 == self.sha256

    def __hash__(self) -> int:
        return hash(self.sha256)

    def __reduce__(self):  # pickles (Dask) as its bytes, not its processor
        return (SentencePieceTokenizer, (self.model,), {"training": self.training})

    def __setstate__(self, state: dict) -> None:
        self.training = state["training"]

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer(vocab_size={self.vocab_size}, sha256={self.sha256[:12]}...)"


def training_sentences(corpus: TranslationCorpus) -> list[str]:
    """The sentences a vocabulary is trained on: every distinct English sentence and translation of
    the corpus's *training* split, sorted (so the vocabulary depends on the training split alone)."""
    if not isinstance(corpus, TranslationCorpus):
        raise TypeError(f"corpus must be a TranslationCorpus, got {type(corpus).__name__}")
    return sorted({text for by_split in corpus.pairs.values() for pair in by_split["train"] for text in pair})


def train_vocabulary(corpus: TranslationCorpus, output: str | os.PathLike | None = None, *,
                     vocab_size: int = VOCABULARY_SIZE) -> SentencePieceTokenizer:
    """Train a shared sentencepiece unigram vocabulary of ``vocab_size`` pieces on ``corpus``'s
    training split (:func:`training_sentences`) and write it to ``output`` (if given).

    Deterministic: one thread, every sentence used, in sorted order; the same training split gives
    the same bytes. Options: no normalisation, whitespace kept, byte fallback (exact round trip),
    character coverage 0.9995 (sentencepiece's advice for languages with large character sets),
    no padding / begin / end ids (the model adds its own).
    """
    import sentencepiece

    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 300:
        raise ValueError(f"vocab_size must be an int >= 300 (256 fallback bytes and some pieces), got {vocab_size!r}")
    sentences = training_sentences(corpus)
    if not sentences:
        raise ValueError("corpus has no training pairs to train a vocabulary on")
    options = dict(model_type="unigram", vocab_size=vocab_size, character_coverage=0.9995, byte_fallback=True,
                   normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
                   num_threads=1, input_sentence_size=0, shuffle_input_sentence=False, hard_vocab_limit=False,
                   unk_id=0, bos_id=-1, eos_id=-1, pad_id=-1, max_sentence_length=16384)
    written = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_writer=written,
                                             minloglevel=2, **options)
    training = {"vocab_size": vocab_size, "options": options, "sentences": len(sentences), "split": "train",
                "sentences_sha256": hashlib.sha256("\n".join(sentences).encode()).hexdigest(),
                "corpus_sources": list(corpus.sources)}
    tokenizer = SentencePieceTokenizer(written.getvalue(), training=training)
    if output is not None:
        tokenizer.save(output)
    return tokenizer


def vocabulary_path() -> Path | None:
    """The shipped vocabulary ``translation/catalogs.vocab.json.gz`` in the first data folder holding it."""
    from carlskit.data._datasets import data_dirs

    for folder in data_dirs():
        path = folder / "translation" / VOCABULARY_FILE
        if path.is_file():
            return path
    return None


def load_vocabulary(path: str | os.PathLike | None = None) -> SentencePieceTokenizer:
    """Read a vocabulary written by :func:`train_vocabulary` (default: the shipped one, trained on
    corpus version 2's training split). Every byte is checked: the gzip CRC, the SHA-256 of the
    document, and the SHA-256 of the model bytes; damage raises :class:`carlskit.CorruptFileError`."""
    if path is None:
        path = vocabulary_path()
        if path is None:
            from carlskit.data._datasets import DatasetNotFoundError

            raise DatasetNotFoundError(f"vocabulary data/translation/{VOCABULARY_FILE} not found; build it with: "
                                       "python -m carlskit.data build vocabulary")
    content = _read_checked_gzip_json(path, (VOCABULARY_FORMAT,), "vocabulary")
    try:
        model = base64.b64decode(content["model"], validate=True)
    except (KeyError, TypeError, ValueError) as error:
        raise CorruptFileError(path, f"vocabulary model is not base64: {error}") from error
    if hashlib.sha256(model).hexdigest() != content.get("model_sha256"):
        raise CorruptFileError(path, "vocabulary model does not match its SHA-256")
    try:
        tokenizer = SentencePieceTokenizer(model, training=content.get("training"))
    except RuntimeError as error:  # sentencepiece refuses a model it cannot parse
        raise CorruptFileError(path, f"not a sentencepiece model: {error}") from error
    if tokenizer.vocab_size != content.get("vocab_size"):
        raise CorruptFileError(path, f"vocabulary has {tokenizer.vocab_size} pieces, its header says "
                                     f"{content.get('vocab_size')}")
    return tokenizer
