"""Rank-side bodies of the observability tests (run inside ``commfuse.launch`` processes): the flight recorder's
dumps after a late rank, a killed rank and a mismatch, and the straggler named by the metrics.

Each returns plain data that the pytest side asserts on; the dumps go to ``COMMFUSE_TRACE_DIR``, which the test
sets for the launch."""

from __future__ import annotations

import logging
import os
import signal
import time

import torch

import commfuse as cf
from commfuse.errors import CommfuseError


def _ints(shape, seed):
    return torch.randint(-2, 3, shape, generator=torch.Generator().manual_seed(seed)).float()


def late_rank(rank, n, k, timeout):
    """Every rank makes calls 0..k-1; rank 2 then sleeps past the timeout before call k, which the others
    make at once. Returns (the error's class, its message) of call k."""
    a, b = _ints((4, 8), rank), _ints((8, 5), 99)
    for _ in range(k):
        cf.all_gather_matmul(a, b, algorithm="ring", timeout=timeout)
    if rank == 2:
        time.sleep(timeout + 1.5)
    try:
        cf.all_gather_matmul(a, b, algorithm="ring", timeout=timeout)
    except CommfuseError as e:
        return type(e).__name__, str(e)
    return "no error", ""


def killed_rank(rank, n, k):
    """Rank 1 is killed (SIGKILL) inside its compute of call k, after posting the call's first step."""
    a = _ints((4, 8), rank)

    def consume(shard, source):
        if rank == 1 and calls[0] == k:
            os.kill(os.getpid(), signal.SIGKILL)
        return shard

    calls = [0]
    for i in range(k + 1):
        calls[0] = i
        try:
            cf.all_gather_consume(a, consume, algorithm="ring", timeout=20)
        except CommfuseError as e:
            return i, type(e).__name__, str(e)
    return k, "no error", ""


def run_then_dump(rank, n, calls, kill_at):
    """One run of a small job. ``kill_at`` None: ``calls`` ring calls, then every rank dumps on demand (the
    files the next run's dumps land beside). Else rank 1 is killed (SIGKILL) inside its compute of call
    ``kill_at``, after posting that call's first step; rank 0's transfers with it fail, in that call or (when
    rank 1's shard had arrived: with two ranks the call's last step has nothing to receive) the next, and it
    dumps. Returns (the paths dumped on demand, or the failed call's number, its error's class)."""
    from commfuse import metrics

    a = _ints((4, 8), rank)
    at = [0]

    def consume(shard, source):
        if rank == 1 and at[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return shard

    for i in range(calls):
        at[0] = i
        try:
            cf.all_gather_consume(a, consume, algorithm="ring", timeout=20)
        except CommfuseError as e:
            return i, type(e).__name__
    return metrics.dump_trace("end of the first run"), None


def mismatch(rank, n, k):
    """Calls 0..k-1 agree; at call k rank 1 passes another shape."""
    b = _ints((8, 5), 99)
    for _ in range(k):
        cf.all_gather_matmul(_ints((4, 8), rank), b, algorithm="ring", timeout=10)
    try:
        cf.all_gather_matmul(_ints((6 if rank == 1 else 4, 8), rank), b, algorithm="ring", timeout=10)
    except CommfuseError as e:
        return type(e).__name__, str(e)
    return "no error", ""


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def straggler(rank, n, calls, slow_rank, slow_s):
    """``slow_rank`` computes ``slow_s`` longer on every call; after each call every rank takes a metrics
    snapshot. Returns, per call, the straggler the snapshot names (-1: none, None: not yet known), and the
    lines the ``commfuse`` logger said."""
    from commfuse import metrics

    kept = _Kept()
    logger = logging.getLogger("commfuse")
    logger.addHandler(kept)
    logger.setLevel(logging.INFO)
    a = _ints((64, 64), rank)

    def consume(shard, source):
        if rank == slow_rank and source == rank:
            time.sleep(slow_s)
        return shard

    named = []
    last = {}
    for _ in range(calls):
        cf.all_gather_consume(a, consume, algorithm="ring", timeout=30)
        snap = metrics.snapshot()
        named.append(snap.get("commfuse/0/straggler_rank"))
        last = snap
    waits = {key: value for key, value in last.items() if "/wait_ms" in key or "straggler" in key or "hidden" in key}
    return named, kept.lines, waits


def loaded(rank, n, calls, rows, late_rank, late_s):
    """Ring all_gather_matmul calls whose GEMM takes tens of ms on a loaded host; ``late_rank`` (-1: none) sleeps
    ``late_s`` before each. After each call every rank takes a metrics snapshot. Returns per call the straggler
    the snapshot names (-1: none, None: not yet known), the last snapshot's straggler figures, and this rank's
    wait and time per call over the window the verdict reads (ms), to show what a failure was judged on."""
    from commfuse import metrics
    from commfuse.runtime.recorder import recorders

    a, b = _ints((rows, 1024), rank), _ints((1024, 1024), 99)
    named, last = [], {}
    for _ in range(calls):
        if rank == late_rank:
            time.sleep(late_s)
        cf.all_gather_matmul(a, b, algorithm="ring", timeout=60)
        last = metrics.snapshot()
        named.append(last.get("commfuse/0/straggler_rank"))
    (rec,) = [r for r in recorders() if r.state.rank is not None]
    window = [c for c in rec.calls() if c.status == "ok" and c.head[0] is not None][-metrics.WINDOW:]
    wait = sum(metrics._waits(c, c.head[0])[0] for c in window) / len(window) / 1e6
    took = sum(c.end - c.start for c in window) / len(window) / 1e6
    return named, {k: v for k, v in last.items() if "straggler" in k}, round(wait, 2), round(took, 2)
