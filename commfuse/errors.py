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


class PluginError(CommfuseError, ValueError):
    """A backend plugin or one of its records is malformed, or two plugins clash."""


class BackendUnavailableError(CommfuseError, RuntimeError):
    """The backend asked for is not installed, cannot run here, or none fits the device."""


class CommfuseWarning(UserWarning):
    """Something was skipped but commfuse carried on (e.g. a broken backend plugin)."""


class CommfuseValueError(CommfuseError, ValueError):
    """An argument with a bad value: a wrong dim, shape, size, dtype or device."""


class CommunicationError(CommfuseError, RuntimeError):
    """A transfer or collective failed; the message names rank, step, peers and collective."""


class CommfuseTimeoutError(CommunicationError, TimeoutError):
    """A wait ran past its timeout; the message names who waited on what."""


class MismatchError(CommunicationError, ValueError):
    """Ranks called one op with different collectives, algorithms, shapes or dtypes."""


class ConcurrentUseError(CommfuseError, RuntimeError):
    """An op was started on a process group while another op was in flight on it (another thread, or a
    consumer calling an op); the message names the group and the op in flight."""


class PeerFailedError(CommunicationError):
    """Another rank's part of the same call failed (its compute, its policy, its transport, or it was
    interrupted); the message names that rank, the op, the call number and the exception type it raised."""


class GroupDeadError(CommunicationError):
    """A process group that a rank declared unusable: every later commfuse call on it raises this, and the
    message says which rank declared it, why, and how to recover (re-create the group)."""


def first_line(error: BaseException | str, limit: int | None = 500, *, named: bool = False) -> str:
    """The one-line summary of ``error`` that a message, a log line or a record quotes: the first line of its
    text, stripped, at most ``limit`` characters (None: all of it); "" when it has no text. ``named`` puts the
    exception's class in front (``"CommunicationError: rank 1 ..."``, the class alone when it has no text).
    ``error`` may be text already (a rank's traceback)."""
    text = error.strip() if isinstance(error, str) else str(error).strip()
    line = text.splitlines()[0] if text else ""
    if limit is not None:
        line = line[:limit]
    if named and not isinstance(error, str):
        return f"{type(error).__name__}: {line}" if line else type(error).__name__
    return line
