"""Argument checks shared by the public constructors, with messages that name the argument."""

from __future__ import annotations

from typing import Any


def is_int_at_least(value: Any, minimum: int) -> bool:
    """True for an int (not a bool) >= ``minimum``.

    Example:
        >>> is_int_at_least(3, 1), is_int_at_least(True, 0), is_int_at_least(2.0, 1)
        (True, False, False)
    """
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def check_int(name: str, value: Any, minimum: int, hint: str = "") -> int:
    """Return ``value`` if it is an int >= ``minimum``, else raise ValueError naming ``name``.

    Example:
        >>> check_int("window", 0, 1)
        Traceback (most recent call last):
        ...
        ValueError: window must be an integer >= 1; got 0
    """
    if not is_int_at_least(value, minimum):
        raise ValueError(f"{name} must be an integer >= {minimum}{hint}; got {value!r}")
    return value
