"""commfuse.strands on gloo ranks: a Llama-style TP block in five stages run as two strands (the next
micro-batch's forward interleaved with the previous one's backward) gives the losses, the gradients and,
after three AdamW steps, the parameters of sequential micro-batches (``_strands_cases``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _strands_cases  # noqa: E402

from commfuse.launch import launch  # noqa: E402


@pytest.mark.parametrize(("n", "plan", "count", "algorithm"), [
    (2, "alternate", 2, "ring"),
    (2, "searched", 2, "ring"),
    (2, "searched", 3, "vanilla"),
    (4, "alternate", 3, "ring"),
    (4, "sequential", 2, "auto"),
])
def test_two_strands_match_sequential_micro_batches(n, plan, count, algorithm):
    results = launch(_strands_cases.strands_match_sequential, n, plan, count, algorithm, timeout=300)
    problems = [f"rank {r}: {p}" for r, res in enumerate(results) for p in res]
    assert not problems, "\n".join(problems[:12])


def test_ranks_holding_different_plans_are_all_told_before_a_stage_runs():
    results = launch(_strands_cases.ranks_disagree_on_the_plan, 3, timeout=300)
    for rank, (kind, message) in enumerate(results):
        assert kind == "MismatchError", (rank, kind, message)
        assert f"rank {rank}" in message and "different stage orders" in message
