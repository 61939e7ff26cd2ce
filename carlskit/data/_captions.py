"""Captioned digits: image/caption pairs for two-tower contrastive learning (CARLS section 4.3).

Every item is one of scikit-learn's 8x8 digits placed on a 12x12 canvas and varied, with a caption
of tokens that *describes that variation*, so a caption is much more than the class:

    image   = clip(noise + background + marks + place(offset_x, offset_y, ink * thicken(stroke, digit)))
    caption = [digit, column, row, ink, stroke, background, marks]   (one word each)

column/row: the digit's offset 0..4 on the canvas (far-left .. far-right, top .. bottom); ink in
{faint, light, medium, dark} (peak 0.4 .. 1.0); stroke in {thin, bold} (bold: thickened by a
one-pixel max filter); background in {plain, grey} (+0.25 everywhere); marks: bright pixels in the
bottom corners {unmarked, left-mark, right-mark, two-marks}. That makes 10 x 5 x 5 x 4 x 2 x 2 x 4
= 16000 captions, and every item gets a different one, so each caption has exactly one matching
image. Retrieval among many same-digit items needs every attribute, and the hard negatives (same
digit, neighbouring position or ink) are rare among a few random ones, which is where more
negatives help. Nothing is downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from carlskit._checks import positive_int

CANVAS = 12
_DIGIT = 8
DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
COLUMN_WORDS = ("far-left", "left", "centre", "right", "far-right")
ROW_WORDS = ("top", "upper", "middle", "lower", "bottom")
INTENSITY_WORDS = ("faint", "light", "medium", "dark")
STROKE_WORDS = ("thin", "bold")
BACKGROUND_WORDS = ("plain", "grey")
MARK_WORDS = ("unmarked", "left-mark", "right-mark", "two-marks")
_SLOTS = (DIGIT_WORDS, COLUMN_WORDS, ROW_WORDS, INTENSITY_WORDS, STROKE_WORDS, BACKGROUND_WORDS, MARK_WORDS)
#: Every word a caption of :func:`load_captioned_digits` can use, in a fixed order (the token ids).
VOCABULARY: tuple[str, ...] = tuple(word for slot in _SLOTS for word in slot)
_INTENSITIES = np.array([0.4, 0.6, 0.8, 1.0], np.float32)


@dataclass(frozen=True)
class PairedDataset:
    """Image/caption pairs: ``images`` [n, 144] float32 in [0, 1], ``tokens`` [n, 7] int32 (indices
    into ``vocabulary``), the digit ``labels`` [n], and disjoint ``train_idx`` / ``test_idx``.
    Item ``i``'s image and caption form a pair; ``i`` is its key in the knowledge bank."""

    name: str
    images: np.ndarray
    tokens: np.ndarray
    labels: np.ndarray
    train_idx: np.ndarray
    test_idx: np.ndarray
    vocabulary: tuple[str, ...] = VOCABULARY

    @property
    def num_items(self) -> int:
        return int(self.images.shape[0])

    def caption(self, index: int) -> str:
        return " ".join(self.vocabulary[t] for t in self.tokens[index])

    def __repr__(self) -> str:
        distinct = len(np.unique(self.tokens, axis=0))
        return (f"PairedDataset({self.name!r}: {self.num_items} image/caption pairs, images "
                f"{self.images.shape[1]} pixels, captions of {self.tokens.shape[1]} tokens from "
                f"{len(self.vocabulary)} words, {distinct} distinct; {len(self.train_idx)} train / "
                f"{len(self.test_idx)} test)")


def load_captioned_digits(num_items: int = 9216, *, num_test: int = 1024, seed: int = 0,
                          noise: float = 0.05) -> PairedDataset:
    """``num_items`` captioned digits (module docstring), generated deterministically from ``seed``.

    The base digits are split first (70% / 30%), so a held-out pair never shows a digit image the
    training pairs were made from; ``num_test`` pairs come from the held-out digits.
    """
    from sklearn.datasets import load_digits as sklearn_digits

    sizes = [len(slot) for slot in _SLOTS]
    if not positive_int(num_test, "num_test") < positive_int(num_items, "num_items"):
        raise ValueError(f"num_test must be < num_items, got {num_test!r} and {num_items!r}")
    if num_items > np.prod(sizes):
        raise ValueError(f"num_items must be <= {np.prod(sizes)} (one distinct caption each), got {num_items}")
    if not 0.0 <= noise < 1.0:
        raise ValueError(f"noise must be in [0, 1), got {noise!r}")
    digits = sklearn_digits()
    bases = (digits.data / 16.0).astype(np.float32).reshape(-1, _DIGIT, _DIGIT)
    rng = np.random.default_rng(seed)
    # Distinct captions: num_items cells of the attribute grid, without replacement.
    attributes = np.stack(np.unravel_index(rng.choice(np.prod(sizes), num_items, replace=False), sizes), axis=1)
    labels, offset_x, offset_y, intensity, stroke, background, marks = attributes.T
    # Base images: training pairs from 70% of the digits, held-out pairs from the other 30%.
    held_out = np.zeros(len(bases), bool)
    held_out[rng.permutation(len(bases))[: int(round(0.3 * len(bases)))]] = True
    test = np.arange(num_items) >= num_items - num_test
    base = np.empty(num_items, np.int64)
    for digit in range(len(DIGIT_WORDS)):
        for in_test in (False, True):
            chosen = (labels == digit) & (test == in_test)
            pool = np.flatnonzero((digits.target == digit) & (held_out == in_test))
            base[chosen] = rng.choice(pool, chosen.sum())

    glyphs = bases[base]
    bold = np.maximum(glyphs, np.pad(glyphs, ((0, 0), (0, 0), (1, 0)))[:, :, :_DIGIT])
    glyphs = np.where(stroke[:, None, None] == 1, bold, glyphs) * _INTENSITIES[intensity][:, None, None]
    images = np.zeros((num_items, CANVAS, CANVAS), np.float32)
    for dy in range(CANVAS - _DIGIT + 1):  # vectorised per offset: 25 slices, not one per item
        for dx in range(CANVAS - _DIGIT + 1):
            chosen = (offset_y == dy) & (offset_x == dx)
            images[chosen, dy:dy + _DIGIT, dx:dx + _DIGIT] = glyphs[chosen]
    images += 0.25 * background[:, None, None]
    images[:, -1, 0] = np.where(marks % 2 == 1, 1.0, images[:, -1, 0])  # left-mark, two-marks
    images[:, -1, -1] = np.where(marks >= 2, 1.0, images[:, -1, -1])  # right-mark, two-marks
    images = np.clip(images + noise * rng.standard_normal(images.shape).astype(np.float32), 0.0, 1.0)

    starts = np.cumsum([0] + sizes[:-1])
    return PairedDataset(
        name="captioned-digits", images=images.reshape(num_items, -1),
        tokens=(attributes + starts).astype(np.int32), labels=labels.astype(np.int64),
        train_idx=np.arange(num_items - num_test, dtype=np.int64),
        test_idx=np.arange(num_items - num_test, num_items, dtype=np.int64))
