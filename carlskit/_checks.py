"""Argument checks shared by every subpackage (plain Python, no JAX: they run at construction or
trace time, never inside a compiled computation). Each error names the argument and what was
expected: ``TypeError`` for a value of the wrong type, ``ValueError`` for one out of range.
"""

from __future__ import annotations

import math
import numbers
from typing import Any


def integer(value: Any, name: str, minimum: int = 1) -> int:
    """``value`` as an ``int`` if it is an integer (not a bool) ``>= minimum``; else TypeError/ValueError naming ``name``."""
    expected = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be {expected}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return int(value)


def positive_int(value: Any, name: str) -> int:
    """``value`` as an ``int`` if it is an integer (not a bool) ``>= 1``; else TypeError/ValueError naming ``name``."""
    return integer(value, name, 1)


def finite_float(value: Any, name: str, *, minimum: float | None = None, positive: bool = False) -> float:
    """``value`` as a finite ``float`` (``> 0`` if ``positive``, ``>= minimum`` if given)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if positive and value <= 0.0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return value


def positive_float(value: Any, name: str) -> float:
    """``value`` as a finite ``float > 0``; else TypeError/ValueError naming ``name``."""
    return finite_float(value, name, positive=True)
