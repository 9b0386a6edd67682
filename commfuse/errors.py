"""The one error hierarchy of commfuse.

Every error a user can see derives from :class:`CommfuseError` and from the
builtin class that fits it (``ValueError``, ``TypeError``, ``TimeoutError``...),
so ``except ValueError`` keeps working for callers who do not know commfuse.
Messages name the thing that was wrong: the rank, step, peer, dim and sizes.
"""

from __future__ import annotations


class CommfuseError(Exception):
    """Base class of every error raised by commfuse."""


class ScheduleError(CommfuseError, ValueError):
    """A schedule was asked for with options that make no sense."""


class InvalidScheduleError(CommfuseError, AssertionError):
    """A built schedule failed its own validation (a bug in a builder)."""


class CommfuseTypeError(CommfuseError, TypeError):
    """An argument of the wrong type."""
