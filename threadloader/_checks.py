"""The check of a count argument, shared by every layer that takes one (and below all of them)."""

from __future__ import annotations

import numbers

__all__ = ["check_count"]


def check_count(name: str, value: object, *, optional: bool = True) -> None:
    """Raises unless ``value`` is an integer of at least 1 (numpy's too), or ``None`` where ``optional``."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        kind = "an int or None" if optional else "an int"
        raise ValueError(f"{name} must be {kind}, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value!r}")
