"""Argument checks shared by every public constructor, with messages that name the argument.

One rule everywhere: a number is any real number type (Python's, numpy's, a 0-d tensor) except
a bool, which is a flag and never a number; an integer is any integral type except a bool.
"""

from __future__ import annotations

import math
import numbers
import sys
from typing import Any


def _tensor_type() -> type | None:
    """torch.Tensor if torch is loaded (a value cannot be a tensor otherwise), without importing it."""
    torch = sys.modules.get("torch")
    return torch.Tensor if torch is not None else None


def as_real(value: Any) -> float | None:
    """``value`` as a float if it is a real number (not a bool), else None.

    Example:
        >>> import numpy as np, torch
        >>> as_real(0.5), as_real(np.float32(0.5)), as_real(torch.tensor(2)), as_real(True), as_real("1")
        (0.5, 0.5, 2.0, None, None)
    """
    tensor = _tensor_type()
    if tensor is not None and isinstance(value, tensor):
        if value.dim() != 0 or value.dtype is sys.modules["torch"].bool or value.is_complex():
            return None
        return float(value.item())
    if is_bool(value) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def as_integer(value: Any) -> int | None:
    """``value`` as an int if it is an integer type (not a bool, not a float), else None.

    Example:
        >>> import numpy as np, torch
        >>> as_integer(3), as_integer(np.int64(3)), as_integer(torch.tensor(3)), as_integer(3.0), as_integer(False)
        (3, 3, 3, None, None)
    """
    tensor = _tensor_type()
    if tensor is not None and isinstance(value, tensor):
        if value.dim() != 0 or value.dtype is sys.modules["torch"].bool or value.is_floating_point():
            return None
        if value.is_complex():
            return None
        return int(value.item())
    if is_bool(value) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def is_bool(value: Any) -> bool:
    """Whether ``value`` is a bool, Python's or numpy's."""
    return isinstance(value, bool) or type(value).__name__ == "bool_"  # numpy's bool is not a Python bool


def interval(low: float | None, high: float | None, *, low_open: bool = False, high_open: bool = False) -> str:
    """The text of an interval, as messages show it: ``in (0, 1]``, ``>= 1``, ``in [-2, 2]``.

    Example:
        >>> interval(0, 1, low_open=True), interval(1, None), interval(None, 5, high_open=True)
        ('in (0, 1]', '>= 1', '< 5')
    """
    if high is None:
        return f"{'>' if low_open else '>='} {low:g}" if low is not None else "finite"
    if low is None:
        return f"{'<' if high_open else '<='} {high:g}"
    return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def in_interval(
    value: float, low: float | None, high: float | None, *, low_open: bool = False, high_open: bool = False
) -> bool:
    """Whether the finite ``value`` lies in the interval."""
    if not math.isfinite(value):
        return False
    if low is not None and (value <= low if low_open else value < low):
        return False
    return high is None or (value < high if high_open else value <= high)


def check_real(
    name: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """``value`` as a float if it is a finite real number in the interval, else ValueError naming ``name``.

    Example:
        >>> check_real("top_p", 0.9, 0, 1, low_open=True)
        0.9
        >>> check_real("top_p", True, 0, 1, low_open=True)
        Traceback (most recent call last):
        ...
        ValueError: top_p must be a number in (0, 1]; got True
    """
    number = as_real(value)
    if number is None or not in_interval(number, low, high, low_open=low_open, high_open=high_open):
        span = interval(low, high, low_open=low_open, high_open=high_open)
        raise ValueError(f"{name} must be a number {span}; got {value!r}")
    return number


def is_int_at_least(value: Any, minimum: int) -> bool:
    """True for an integer (not a bool) >= ``minimum``.

    Example:
        >>> is_int_at_least(3, 1), is_int_at_least(True, 0), is_int_at_least(2.0, 1)
        (True, False, False)
    """
    number = as_integer(value)
    return number is not None and number >= minimum


def check_int(name: str, value: Any, minimum: int, hint: str = "", maximum: int | None = None) -> int:
    """``value`` as an int if it is an integer in [minimum, maximum], else ValueError naming ``name``.

    Example:
        >>> check_int("window", 0, 1)
        Traceback (most recent call last):
        ...
        ValueError: window must be an integer >= 1; got 0
        >>> check_int("num_beams", 5000, 1, maximum=1024)
        Traceback (most recent call last):
        ...
        ValueError: num_beams must be an integer in [1, 1024]; got 5000
    """
    number = as_integer(value)
    if number is None or number < minimum or (maximum is not None and number > maximum):
        span = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be an integer {span}{hint}; got {value!r}")
    return number
