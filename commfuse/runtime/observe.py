"""Observing calls: the measurement modes, the per-step event timeline, the profiler and the trace log.

While nothing observes (no :func:`measure` or :func:`record_events` scope
open in any thread, no profiler, no ``COMMFUSE_TRACE``), a call reads one
counter and one flag and takes the loop's plain walk; ``runtime.walks`` reads
these switches once per call, not per step.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from commfuse.errors import CommfuseValueError
from commfuse.runtime.env import flag


MODES = ("compute_only", "comm_only", "outside_only")
_local = threading.local()
#: How many ``measure``/``record_events`` scopes are open in any thread: while none is, a call reads no
#: thread-local state at all (a one-item list, so that readers bind it once).
observers = [0]


def measuring() -> str | None:
    """The :func:`measure` mode this thread runs ops in (None: normally)."""
    return getattr(_local, "value", None) if observers[0] else None


def mode_of() -> str | None:
    """This thread's measurement mode, for a call that has seen ``observers[0]`` non-zero."""
    return getattr(_local, "value", None)


def events_of() -> list | None:
    """The list this thread's :func:`record_events` scope collects into, if one is open."""
    return getattr(_local, "events", None)


@contextlib.contextmanager
def measure(mode: str | None):
    """Run ops with their transfers removed (``"compute_only"``), their compute removed (``"comm_only"``), or
    both (``"outside_only"``).

    The benchmark uses it to time the same schedule's two halves apart: with
    ``compute_only`` every post completes at once and receive buffers keep
    whatever they held (results are garbage, timings are those of the
    per-shard compute and the loop); with ``comm_only`` the programs skip
    their compute (reduce-scatter sends uninitialised partials of the right
    shape). With ``outside_only`` the ops do neither (posts complete at once, compute is skipped), so only
    the caller's code around them runs: a step's time in it is what ``comm_only`` also spent outside the
    ops (a block's attention core, its norms, a weight-gradient GEMM autograd runs apart from the ring),
    and ``comm_only`` less ``outside_only`` is the transfers alone. The fingerprint check is skipped in all
    three. ``None`` is normal.
    """
    if mode is not None and mode not in MODES:
        raise CommfuseValueError(f"measure mode must be one of {MODES} or None, got {mode!r}")
    previous = getattr(_local, "value", None)
    _local.value = mode
    observers[0] += 1
    try:
        yield
    finally:
        observers[0] -= 1
        _local.value = previous


class unmeasured:
    """Run ops normally inside a :func:`measure` scope (an uneven all-to-all's sizes must really travel)."""

    __slots__ = ("previous",)

    def __enter__(self) -> "unmeasured":
        self.previous = measuring()
        if self.previous is not None:
            _local.value = None
        return self

    def __exit__(self, *exc) -> bool:
        if self.previous is not None:
            _local.value = self.previous
        return False


@contextlib.contextmanager
def record_events():
    """Collect the per-step timeline of every ``execute`` in this thread into a list.

    Each entry is a per-step dict (``step``, ``post``, ``compute``, ``wait``
    as (start, end) ``time.perf_counter()`` seconds, ``sends``/``recvs`` as
    (peer, channel), ``collectives``) plus ``label`` (the op) and
    ``algorithm``. The benchmark builds its traces and Gantt charts from these.
    """
    previous = getattr(_local, "events", None)
    events: list[dict] = []
    _local.events = events
    observers[0] += 1
    try:
        yield events
    finally:
        observers[0] -= 1
        _local.events = previous


NULL_SCOPE = contextlib.nullcontext()


def trace_enabled() -> bool:
    """Whether ``COMMFUSE_TRACE`` asks for the per-rank step log on stderr."""
    return flag("COMMFUSE_TRACE", False)


def profiler_on() -> bool:
    """Whether a torch profiler runs (then every step is a ``record_function`` range)."""
    return torch.autograd.profiler._is_profiler_enabled
