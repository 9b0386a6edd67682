"""Tier (b), real gloo ranks: the planning table holds at most its bound in bytes while a tensor-parallel MLP
(commfuse.tp's styles, sequence parallel) and the fused ops run many call signatures; every result stays
torch's, whatever each rank's table evicts and when (ranks with other bounds, autograd graphs made before the
evictions, a thread whose entries are evicted while its calls run)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _plan_bound_cases  # noqa: E402

from commfuse.launch import launch  # noqa: E402

BOUND = 256 * 1024  # about eight of the MLP's signatures, each with its receive buffers


@functools.lru_cache(maxsize=None)
def _results(body: str, n: int, *args, env: tuple = ()) -> list[dict]:
    return launch(getattr(_plan_bound_cases, body), n, *args, timeout=600, env=dict(env))


def _check(results: list[dict], name: str) -> None:
    errors = {r: res.get(name, "did not run") for r, res in enumerate(results) if res.get(name, "missing")}
    assert not errors, "\n".join(f"rank {r}: {e}" for r, e in errors.items())


def test_the_live_tensor_bytes_stay_within_the_bound_over_many_shapes():
    """120 shapes at hidden 32; without the bound the receive buffers of every shape stay (about 1 MB here)."""
    results = _results("bound_holds", 2, BOUND, 120, env=(("COMMFUSE_PLAN_BYTES", str(BOUND)),))
    _check(results, "bound-holds")


@pytest.mark.parametrize("name", ("styles", "uneven-op"))
def test_ranks_that_evict_differently_stay_in_step(name):
    _check(_results("ranks_evict_differently", 3), name)


def test_a_thread_whose_entries_are_evicted_while_its_calls_run_gets_exact_results():
    _check(_results("thread_in_flight", 2), "threads")
