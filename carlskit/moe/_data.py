"""A generated "multilingual" corpus needing no download, for MoE demonstrations and benchmarks."""

from __future__ import annotations

import numpy as np

from carlskit._checks import finite_float, positive_int


def toy_multilingual_corpus(
    num_sequences: int,
    length: int,
    *,
    num_languages: int = 8,
    vocab_size: int = 128,
    branching: int = 2,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Token sequences from ``num_languages`` random Markov "languages".

    Each language has its own table: the token after ``a`` is drawn from ``branching``
    successors fixed per language, with Dirichlet(1) weights. All languages share the vocabulary,
    so a model must infer the language from context and store one table per language: a
    memorisation-heavy mix where extra (expert) parameters help, like GShard's multilingual data.

    Returns ``(tokens [num_sequences, length + 1] int32, language [num_sequences] int32)``.
    Deterministic in ``seed`` (the tables depend only on ``seed``, ``num_languages``,
    ``vocab_size`` and ``branching``).
    """
    for name, value in (("num_sequences", num_sequences), ("length", length), ("num_languages", num_languages),
                        ("vocab_size", vocab_size), ("branching", branching)):
        positive_int(value, name)
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    tables = np.random.default_rng(seed)
    successors = tables.integers(0, vocab_size, (num_languages, vocab_size, branching))
    weights = tables.dirichlet(np.ones(branching), (num_languages, vocab_size))
    cumulative = np.cumsum(weights, axis=-1)
    sampler = np.random.default_rng([seed, num_sequences, length])
    language = sampler.integers(0, num_languages, num_sequences)
    tokens = np.empty((num_sequences, length + 1), np.int64)
    tokens[:, 0] = sampler.integers(0, vocab_size, num_sequences)
    for t in range(1, length + 1):
        current = tokens[:, t - 1]
        choice = (sampler.random(num_sequences)[:, None] > cumulative[language, current]).sum(-1)
        choice = np.minimum(choice, branching - 1)
        tokens[:, t] = successors[language, current, choice]
    return tokens.astype(np.int32), language.astype(np.int32)


#: The byte-level vocabulary: the 256 byte values and one padding id.
BYTE_VOCAB_SIZE = 257  # the 256 byte values and one padding id
#: The padding token id (ignored by the loss).
PAD_ID = 256


def stdlib_text_documents() -> list[bytes]:
    """English paragraphs (UTF-8 bytes) from the Python documentation shipped with CPython.

    ``pydoc_data.topics`` is the text of the Language Reference's topics that ``help()`` prints
    (about 466 KB for Python 3.11): real English technical prose with code, present in every
    standard CPython installation, so nothing is downloaded (the content depends on the Python
    version, the same for every installation of one version). Split at blank lines into
    paragraphs, each distinct paragraph once: documents of very different lengths (tens of bytes
    to a few KB).
    """
    from pydoc_data.topics import topics

    documents, seen = [], set()
    for name in sorted(topics):
        for paragraph in topics[name].split("\n\n"):
            document = paragraph.strip("\n").encode("utf-8")
            # A fifth of the paragraphs repeat elsewhere (shared notes, headings, grammar lines):
            # kept once, so no held-out paragraph is also a training paragraph.
            if paragraph.strip() and document not in seen:
                seen.add(document)
                documents.append(document)
    return documents


def stdlib_text_corpus(
    length: int, *, validation_fraction: float = 0.1, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Byte-level LM rows from :func:`stdlib_text_documents` with a held-out split.

    Paragraphs are shuffled with ``seed`` and the last ``validation_fraction`` of them held out
    (whole paragraphs, so no validation text is seen in training). Each paragraph is cut into
    rows of ``length + 1`` bytes (inputs and next-byte targets; consecutive rows of one paragraph
    share one byte so every byte after the first is a target once); a paragraph's last row is
    right-padded with :data:`PAD_ID` (256). Use with ``MoEModel(vocab_size=257, pad_id=256)``:
    padded positions are routed nowhere and left out of the loss.

    Returns ``(train [N, length + 1] int32, validation [M, length + 1] int32)``.
    """
    length = positive_int(length, "length")
    if not 0.0 < finite_float(validation_fraction, "validation_fraction") < 1.0:
        raise ValueError(f"validation_fraction must be in (0, 1), got {validation_fraction!r}")
    documents = stdlib_text_documents()
    order = np.random.default_rng(seed).permutation(len(documents))
    held_out = max(1, int(round(validation_fraction * len(documents))))
    splits = (order[:-held_out], order[-held_out:])
    return tuple(_rows([documents[i] for i in part], length) for part in splits)  # type: ignore[return-value]


def _rows(documents: list[bytes], length: int) -> np.ndarray:
    """Cut byte strings into right-padded rows of ``length + 1`` tokens (at least one target each)."""
    rows = []
    for document in documents:
        data = np.frombuffer(document, np.uint8).astype(np.int32)
        for start in range(0, max(1, len(data) - 1), length):
            piece = data[start : start + length + 1]
            if len(piece) < 2:
                continue
            row = np.full(length + 1, PAD_ID, np.int32)
            row[: len(piece)] = piece
            rows.append(row)
    return np.stack(rows)
