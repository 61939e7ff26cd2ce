import numpy as np
import pytest

from carlskit.data import VOCABULARY, load_captioned_digits


def test_captioned_digits_are_distinct_deterministic_and_describe_their_image():
    data = load_captioned_digits(2000, num_test=300, seed=2)
    assert data.images.shape == (2000, 144) and data.tokens.shape == (2000, 7)
    assert 0.0 <= data.images.min() and data.images.max() <= 1.0
    assert len(np.unique(data.tokens, axis=0)) == 2000, "every pair has its own caption"
    assert len(data.train_idx) == 1700 and np.array_equal(data.test_idx, np.arange(1700, 2000))
    again = load_captioned_digits(2000, num_test=300, seed=2)
    np.testing.assert_array_equal(data.images, again.images)
    images = data.images.reshape(-1, 12, 12)
    for i in range(2000):
        digit, column, row, ink, stroke, background, marks = data.caption(i).split()
        assert VOCABULARY.index(digit) == data.labels[i]
        assert (images[i, -1, 0] > 0.75) == (marks in ("left-mark", "two-marks"))
        assert (images[i, -1, -1] > 0.75) == (marks in ("right-mark", "two-marks"))
    grey = np.array([data.caption(i).split()[5] == "grey" for i in range(2000)])
    assert np.median(images[grey][:, 0, 5]) > 0.2 > np.median(images[~grey][:, 0, 5])
    with pytest.raises(ValueError, match="num_test"):
        load_captioned_digits(100, num_test=100)
    with pytest.raises(ValueError, match="one distinct caption"):
        load_captioned_digits(20000)
