"""Tier (b) in the torchtitan environment, real gloo ranks: ``commfuse.nn.MoE`` with each DeepSeek-style routing
option (route_scale, a router bias, the expert bias and its update, node-limited routing, shared experts, all at
once) equals torchtitan 0.3's own MoE module with the same weights, run unparallelized on every rank as the
reference, with skewed routing: outputs and gradients within fp32 tolerance (``_moe_routing_cases``)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _moe_routing_cases  # noqa: E402

from commfuse.launch import launch  # noqa: E402


def _on_rank(rank: int, n: int, algorithms: list[str]) -> dict[str, list[str]]:
    # what launch runs: a function of this module, which the ranks import by its name
    return _moe_routing_cases.routing_matches_torchtitan(rank, n, algorithms)


@functools.cache
def _results(n: int) -> list[dict[str, list[str]]]:
    algorithms = ["vanilla", "ring", "ring:2"] if n == 2 else ["vanilla", "ring"]
    return launch(_on_rank, n, algorithms, timeout=600)


@pytest.mark.parametrize("n", (2, 4))
@pytest.mark.parametrize("option_set", list(_moe_routing_cases.OPTION_SETS))
def test_moe_routing_equals_torchtitans(n, option_set):
    results = _results(n)
    problems = {rank: res[option_set] for rank, res in enumerate(results) if res[option_set]}
    assert not problems, "\n".join(f"rank {rank}: {p}" for rank, ps in problems.items() for p in ps)
