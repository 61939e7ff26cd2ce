"""Argument checks shared by every subpackage (plain Python, no JAX: they run at construction or
trace time, never inside a compiled computation). Each error names the argument and what was
expected: ``TypeError`` for a value of the wrong type, ``ValueError`` for one out of range.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Sequence
from typing import Any

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def integer(value: Any, name: str, minimum: int = 1, maximum: int | None = None, why: str = "") -> int:
    """``value`` as an ``int`` if it is an integer (not a bool) in ``[minimum, maximum]``; else
    TypeError/ValueError naming ``name``. ``maximum`` bounds size arguments (a huge ``bins`` or
    capacity must be a clear ``ValueError``, never a ``MemoryError`` later); ``why`` (e.g.
    ``" (rows are int32)"``) is added to the message of a value out of range."""
    expected = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    if maximum is not None:
        expected = f"an int in [{minimum}, {maximum}]"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be {expected}, got {value!r} ({type(value).__name__})")
    if maximum is None and not INT64_MIN <= value <= INT64_MAX:  # counts, seeds, versions are stored as int64
        raise ValueError(f"{name} must fit in int64 [-2**63, 2**63 - 1], got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be {'a positive int' if minimum == 1 else f'>= {minimum}'}{why}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}{why}, got {value!r}")
    return int(value)


def int64(value: Any, name: str = "step") -> int:
    """``value`` as an ``int`` if it is a real integer (Python or numpy, or a 0-d integer array such
    as a JAX step counter; not a bool, not a string or a float such as ``1.7`` or ``5.0``) that fits
    in a signed 64-bit integer (steps are stored as int64); else TypeError/ValueError naming
    ``name``."""
    if type(value) is int:  # the common case, checked without the ABC machinery
        if INT64_MIN <= value <= INT64_MAX:
            return value
    elif isinstance(value, bool) or not (isinstance(value, numbers.Integral) or _integer_scalar_array(value)):
        raise TypeError(f"{name} must be an int (int64), got {value!r} ({type(value).__name__})")
    value = int(value)
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"{name} must fit in int64 [-2**63, 2**63 - 1], got {value!r}")
    return value


def positive_int(value: Any, name: str) -> int:
    """``value`` as an ``int`` if it is an integer (not a bool) ``>= 1``; else TypeError/ValueError naming ``name``."""
    return integer(value, name, 1)


def finite_float(value: Any, name: str, *, minimum: float | None = None, positive: bool = False,
                 allow_infinity: bool = False) -> float:
    """``value`` as a finite ``float`` (``> 0`` if ``positive``, ``>= minimum`` if given; ``+inf``
    too with ``allow_infinity``, e.g. a time-to-live that never expires)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    value = float(value)
    if not (math.isfinite(value) or (allow_infinity and value == math.inf)):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if positive and value <= 0.0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return value


def positive_float(value: Any, name: str) -> float:
    """``value`` as a finite ``float > 0``; else TypeError/ValueError naming ``name``."""
    return finite_float(value, name, positive=True)


def choice(value: Any, name: str, allowed: Sequence[str]) -> str:
    """``value`` if it is one of the strings ``allowed``; else TypeError (not a str) or ValueError
    (another str) naming ``name`` and the choices."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {list(allowed)}, got {value!r} ({type(value).__name__})")
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
    return value


def boolean(value: Any, name: str) -> bool:
    """``value`` if it is a ``bool`` (not 0/1, not a string); else TypeError naming ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return value


def instance(value: Any, name: str, types: type | tuple[type, ...], expected: str) -> Any:
    """``value`` if it is an instance of ``types``; else TypeError naming ``name`` and what was
    ``expected`` (e.g. ``"a flax.nnx.Module"``)."""
    if not isinstance(value, types):
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__}")
    return value


def path(value: Any, name: str) -> str | os.PathLike:
    """``value`` if it is a path (``str`` or ``os.PathLike``); else TypeError naming ``name``;
    ValueError naming it when the file system cannot encode it (a lone surrogate such as
    ``"\ud800"``; the surrogate-escaped bytes of ``os.listdir`` are fine)."""
    instance(value, name, (str, os.PathLike), "a path (str or os.PathLike)")
    text = os.fspath(value)
    if isinstance(text, str):
        try:
            os.fsencode(text)
        except UnicodeEncodeError as error:
            raise ValueError(f"{name} must be a path the file system can encode, got {text!r} (an "
                             f"unpaired surrogate at position {error.start})") from None
    return value


def _integer_scalar_array(value: Any) -> bool:
    """A 0-d array of an integer dtype (numpy or JAX), told by its dtype, not by importing either."""
    dtype = getattr(value, "dtype", None)
    return getattr(value, "shape", None) == () and getattr(dtype, "kind", None) in ("i", "u")


def utf8(value: str, name: str) -> bytes:
    """``value`` (a str) encoded as UTF-8; ValueError naming ``name`` when it cannot be (a lone
    surrogate such as ``"\\ud800"``, which Python strings may hold and UTF-8 may not)."""
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{name} must be encodable as UTF-8, got {value!r} (an unpaired surrogate at "
                         f"position {error.start})") from None


def real_array(value: Any, name: str) -> Any:
    """``value`` as a numpy array of a real or bool dtype; ValueError naming ``name`` for a ragged
    nesting, TypeError for ``None``, strings, objects or complex numbers."""
    import numpy as np  # here: the checks above stay importable without numpy

    if value is None or isinstance(value, (str, bytes)):
        raise TypeError(f"{name} must be a real-valued array, got {type(value).__name__}")
    try:
        array = np.asarray(value)
    except (ValueError, TypeError) as error:  # numpy: "inhomogeneous shape after 1 dimensions"
        raise ValueError(f"{name} must be a real-valued array of one shape, got a ragged or unconvertible "
                         f"{type(value).__name__} ({error})") from None
    if array.dtype.kind not in "biuf":
        raise TypeError(f"{name} must be a real-valued array, got dtype {array.dtype} (shape {array.shape})")
    return array
