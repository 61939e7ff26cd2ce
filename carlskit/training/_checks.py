"""Argument checks shared by the training and makers code (Python only, at construction time).

The same checks as ``carlskit.lopt._checks``; kept here so training does not import lopt.
"""

from __future__ import annotations

import math
import numbers
from typing import Any


def positive_int(value: Any, name: str) -> int:
    """``value`` as an ``int`` if it is an integer (not a bool) ``>= 1``; else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def positive_float(value: Any, name: str) -> float:
    """``value`` as a finite ``float > 0``; else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)
