"""The checks of count arguments and switches, shared by every layer that takes one (below all of them)."""

from __future__ import annotations

import numbers
import os

__all__ = ["check_count", "check_switch", "env_flag"]

_ON = ("1", "true", "on", "yes")
_OFF = ("0", "false", "off", "no")


def check_count(name: str, value: object, *, optional: bool = True) -> None:
    """Raises unless ``value`` is an integer of at least 1 (numpy's too), or ``None`` where ``optional``."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        kind = "an int or None" if optional else "an int"
        raise ValueError(f"{name} must be {kind}, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value!r}")


def check_switch(name: str, value: object, *, also: str = "") -> bool:
    """``value`` as a bool; raises unless it is True or False (1, 0 and numpy's bools too).

    Any object is truthy, so ``shuffle="no"`` shuffled: a switch takes what says on or off, nothing else.
    What it returns is a plain bool, so a numpy bool does not travel into a state dict or a log line.
    ``also`` names what else the caller takes, for the message (``"or None"``).
    """
    if isinstance(value, bool) or (isinstance(value, numbers.Integral) and value in (0, 1)):
        return bool(value)
    if getattr(value, "shape", None) == () and getattr(getattr(value, "dtype", None), "kind", None) == "b":
        return bool(value)  # numpy.True_ and the like
    accepted = f"True, False {also}" if also else "True or False"
    raise TypeError(f"{name} must be {accepted}, got {value!r} ({type(value).__name__})")


def env_flag(name: str, *, default: bool) -> bool:
    """An on/off environment variable: unset or empty is ``default``, else 1 or 0 (true/false, on/off...).

    Raises:
        ValueError: For any other value, naming the variable: ``false`` read as "not 0" turned it on.
    """
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _ON or value in _OFF:
        return value in _ON
    raise ValueError(f"{name} must be 1 or 0 (or true/false, on/off, yes/no), got {os.environ[name]!r}")
