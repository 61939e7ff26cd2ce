"""benchmarks/_timing.py: interleaved repeats, rotated order, medians of per-repeat ratios and their spread."""

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("_timing", Path(__file__).parents[1] / "benchmarks" / "_timing.py")
timing = importlib.util.module_from_spec(spec)
spec.loader.exec_module(timing)


def test_variants_are_interleaved_in_rotated_order_after_one_warmup_each():
    calls = []
    variants = {name: (lambda name=name: calls.append(name) or 1.0) for name in "abc"}
    samples = timing.interleave(variants, repeats=3)
    assert calls == list("abc") + list("abc") + list("bca") + list("cab")
    assert samples == {name: [1.0, 1.0, 1.0] for name in "abc"}


def test_a_ratio_is_the_median_of_per_repeat_ratios_with_its_spread():
    # The load doubles in the second repeat: both variants slow down, their ratio does not move.
    samples = {"large": [2.0, 4.0, 2.2], "small": [1.0, 2.0, 1.0]}
    assert timing.ratio(samples, "large", "small", "r") == pytest.approx({"r": 2.0, "r_spread": 0.1})
    assert timing.medians(samples) == {"large": 2.2, "small": 1.0}


def test_a_variant_returning_no_float_is_timed_by_wall_clock():
    samples = timing.interleave({"array": lambda: [0] * 10}, repeats=2, warmup=False)
    assert all(0 <= s < 1.0 for s in samples["array"])
    with pytest.raises(ValueError, match="repeats"):
        timing.interleave({"a": lambda: 1.0}, repeats=0)
