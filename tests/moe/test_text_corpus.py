"""The stdlib byte-level text corpus and the MoE vs dense text comparison."""

import numpy as np
import pytest

from carlskit.moe import PAD_ID, stdlib_text_corpus, stdlib_text_documents, text_lm_comparison


def test_corpus_rows_are_right_padded_paragraphs_with_held_out_ones():
    documents = stdlib_text_documents()
    assert len(documents) == len(set(documents)) > 1000  # distinct paragraphs (a fifth repeat in pydoc)
    assert sum(map(len, documents)) > 300_000  # ~370 KB of distinct paragraphs on Python 3.11
    train, validation = stdlib_text_corpus(32, validation_fraction=0.1, seed=0)
    assert train.shape[1] == validation.shape[1] == 33 and train.dtype == np.int32
    assert 0.05 < len(validation) / (len(train) + len(validation)) < 0.2
    for rows in (train, validation):
        real = rows != PAD_ID
        assert real[:, :2].all()  # every row has at least one target
        # padding only at the end of a row: once padded, padded to the end
        assert not (np.diff(real.astype(int), axis=1) > 0).any()
        assert rows.min() >= 0 and rows[real].max() < 256
    # Whole distinct paragraphs are held out: only rows of common short text (e.g. a version
    # note) can occur on both sides (before deduplication: 44% of the validation rows).
    seen = {row.tobytes() for row in train}
    assert np.mean([row.tobytes() in seen for row in validation]) < 0.05
    # A one-row paragraph reads back as its bytes.
    short = next(d for d in documents if 2 <= len(d) <= 33)
    row = np.full(33, PAD_ID, np.int32)
    row[: len(short)] = np.frombuffer(short, np.uint8)
    both = np.concatenate([train, validation])
    assert (both == row).all(axis=1).any()
    with pytest.raises(ValueError, match="validation_fraction"):
        stdlib_text_corpus(32, validation_fraction=1.0)
    with pytest.raises((TypeError, ValueError), match="length"):
        stdlib_text_corpus(0)


@pytest.mark.slow
def test_text_comparison_trains_moe_and_dense_on_the_same_steps():
    runs = text_lm_comparison((0, 4), size="small", steps=4)
    dense, moe = runs
    assert (dense["num_experts"], moe["num_experts"]) == (0, 4)
    assert dense["steps"] == moe["steps"] == [4]
    assert moe["parameters"] > dense["parameters"]
    for run in runs:
        assert 1.0 < run["validation_bpb"][-1] < 9.0  # bits per byte of a barely trained byte model
        assert run["seconds"][-1] > 0
    with pytest.raises(ValueError, match="size"):
        text_lm_comparison((0,), size="huge")
