"""Numbers that commfuse reads from the environment: one place that parses them and refuses, by name, a value
that is not a number or is out of range (``COMMFUSE_GRACE_S``, ``COMMFUSE_RECORDER``, ``COMMFUSE_STRAGGLER_MS``,
``COMMFUSE_STRAGGLER_SHARE``)."""

from __future__ import annotations

import os

from commfuse.errors import CommfuseValueError

__all__ = ["number"]


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
