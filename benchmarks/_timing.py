"""Host time per call for the host-cost benchmarks (``site_overhead.py``, ``torchtitan_host.py``). Imported from
the scripts' own folder, which Python puts first on the path when it runs one of them."""

from __future__ import annotations

import statistics
import time


def per_call(fn, calls: int, rounds: int, warmup: int = 3) -> float:
    """Seconds per call of ``fn()``: the median over ``rounds`` of the mean of ``calls`` calls, after ``warmup``
    calls."""
    for _ in range(warmup):
        fn()
    means = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        means.append((time.perf_counter() - t0) / calls)
    return statistics.median(means)
