"""A generated "multilingual" corpus needing no download, for MoE demonstrations and benchmarks."""

from __future__ import annotations

import numpy as np

from carlskit._checks import positive_int


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
