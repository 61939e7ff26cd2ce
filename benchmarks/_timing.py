"""Timings that hold still on a shared machine: interleave the compared variants, repeat, report the
median and the spread of each ratio.

A ratio of two timings taken one after the other moves with the machine's load between them (issue
31: ``t64_over_t8`` 1.46 / 1.66 / 1.74 in three identical runs). Here every repeat measures each
variant once, in an order rotated from repeat to repeat (so no variant is always first after a
pause), and a ratio is formed *within* each repeat, from measurements seconds apart; the reported
ratio is the median over repeats, and ``NAME_spread`` is ``(max - min) / median`` of the per-repeat
ratios: how far identical measurements disagreed in this run. Size the repeats so that the median
holds still across runs (three back-to-back runs within 10%); the spread says when it cannot.

    samples = interleave({"small": lambda: time_it(...), "large": ...}, repeats=7)
    results.update(ratio(samples, "large", "small", "large_over_small"))
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def interleave(variants: dict[str, Callable[[], object]], repeats: int,
               warmup: bool = True) -> dict[str, list[float]]:
    """Measure each variant ``repeats`` times, one of each per repeat, order rotated per repeat.

    A variant is a zero-argument callable that returns its own measurement in seconds as a
    ``float`` (e.g. time per step of a fit it ran); if it returns anything else (``None``, an
    array), the call's wall time is the measurement. With
    ``warmup`` each variant is called once first, unmeasured (compilation, caches). Returns
    ``{name: [seconds per repeat]}``.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    names = list(variants)
    if warmup:
        for name in names:
            variants[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            measured = variants[name]()
            seconds = time.perf_counter() - start
            samples[name].append(float(measured) if isinstance(measured, float) else seconds)
    return samples


def ratio(samples: dict[str, list[float]], numerator: str, denominator: str, key: str) -> dict[str, float]:
    """``{key: median of the per-repeat ratios, key + "_spread": (max - min) / median}``."""
    ratios = [a / b for a, b in zip(samples[numerator], samples[denominator], strict=True)]
    median = statistics.median(ratios)
    return {key: median, f"{key}_spread": (max(ratios) - min(ratios)) / median}


def medians(samples: dict[str, list[float]]) -> dict[str, float]:
    """The median seconds of each variant."""
    return {name: statistics.median(values) for name, values in samples.items()}
