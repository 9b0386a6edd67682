"""Numbers that commfuse reads from the environment: one place that parses them and refuses, by name, a value
that is not a number or is out of range (``COMMFUSE_GRACE_S``, ``COMMFUSE_RECORDER``, ``COMMFUSE_STRAGGLER_MS``,
``COMMFUSE_STRAGGLER_SHARE``)."""

from __future__ import annotations

import os

from commfuse.errors import CommfuseValueError

__all__ = ["number", "size"]


def number(name: str, default, low, high, *, kind=float, unit: str = "seconds"):
    """The variable ``name`` as a ``kind`` (float or int) from ``low`` to ``high``; ``default`` when it is unset
    or empty. Anything else raises :class:`CommfuseValueError` naming the variable, the value and the range."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = kind(text)
    except ValueError:
        raise CommfuseValueError(f"{name} must be a number of {unit}, got {text!r}") from None
    if not low <= value <= high:
        raise CommfuseValueError(f"{name}={text} is out of range: give {unit} from {low:g} to {high:g}")
    return value


#: The units :func:`size` reads after a number, in bytes (binary, as the allocators count).
_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def size(name: str, default: int, low: int, high: int) -> int:
    """The variable ``name`` (``COMMFUSE_PLAN_BYTES``) as a number of bytes from ``low`` to ``high``: an integer, or a number followed by
    ``KiB``, ``MiB``, ``GiB`` or ``TiB`` (``512MiB``, ``1.5GiB``); ``default`` when it is unset or empty.
    Anything else raises :class:`CommfuseValueError` naming the variable, the value and the forms it takes."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    number = text.rstrip("BbIiKkMmGgTt ")
    unit = text[len(number):].strip().lower()
    try:
        value = int(float(number) * _UNITS[unit]) if unit else int(number)
    except (KeyError, ValueError, OverflowError):
        raise CommfuseValueError(
            f"{name} must be a number of bytes, alone or followed by KiB, MiB, GiB or TiB (such as 536870912 or "
            f"512MiB), got {text!r}"
        ) from None
    if not low <= value <= high:
        raise CommfuseValueError(f"{name}={text} is out of range: give bytes from {low} to {high}")
    return value
