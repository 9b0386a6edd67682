"""commfuse.strands on gloo ranks (tier b): an MoE block under expert parallelism in five stages, its dispatch
and combine each a differentiable overlapped exchange, gives the losses, gradients and, after three AdamW steps,
the parameters of sequential micro-batches, and the outputs and gradients of ``moe_reference`` on one process
(``_strands_moe_cases``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _strands_cases  # noqa: E402
import _strands_moe_cases  # noqa: E402

from commfuse.launch import launch  # noqa: E402


def _problems(results) -> list[str]:
    return [f"rank {r}: {p}" for r, res in enumerate(results) for p in res]


@pytest.mark.parametrize("n", [2, 4])
def test_moe_stages_as_two_strands_match_sequential_micro_batches(n):
    results = launch(_strands_moe_cases.strands_match_sequential, n, ["alternate", "searched", "sequential"], 2,
                     "ring", timeout=300)
    problems = _problems(results)
    assert not problems, "\n".join(problems[:12])


@pytest.mark.parametrize(("n", "algorithm", "plan"), [(2, "ring:2", "searched"), (4, "ring", "alternate")])
def test_moe_stages_equal_the_one_process_reference(n, algorithm, plan):
    problems = _problems(launch(_strands_moe_cases.matches_reference, n, algorithm, plan, timeout=300))
    assert not problems, "\n".join(problems[:12])


@pytest.mark.parametrize(("mutant", "named"), [("dgrad", "input gradient"), ("wgrad", "gradient of w13")])
def test_a_wrong_dispatch_backward_fails_the_reference_comparison(mutant, named):
    problems = _problems(launch(_strands_moe_cases.wrong_dispatch_backward_is_caught, 2, mutant, timeout=300))
    assert any(named in p for p in problems), problems


def test_one_process_without_torch_distributed_is_the_reference():
    problems = _strands_moe_cases.against_reference(0, 1, "ring", "alternate")
    assert not problems, "\n".join(problems)


def test_counts_of_the_wrong_shape_are_named():
    import torch

    from commfuse.errors import CommfuseValueError
    from commfuse.nn.moe import dispatch_experts, experts_combine

    xs, w13, w2 = torch.randn(6, 8), torch.randn(2, 8, 16), torch.randn(2, 8, 8)
    with pytest.raises(CommfuseValueError, match=r"rank 0: send_counts must be .*\(world size 1, local experts 2\)"):
        dispatch_experts(xs, w13, torch.tensor([[3, 3], [0, 0]]))
    with pytest.raises(CommfuseValueError, match="rank 0: send_counts sum to 5 rows, xs has 6"):
        dispatch_experts(xs, w13, torch.tensor([[3, 2]]))
    acts, recv = dispatch_experts(xs, w13, torch.tensor([[4, 2]]))
    assert acts.shape == (6, 8) and recv.tolist() == [[4, 2]]
    with pytest.raises(CommfuseValueError, match="rank 0: recv_counts sum to 5 rows, acts has 6"):
        experts_combine(acts, w2, torch.tensor([[3, 2]]), torch.tensor([[4, 2]]))


@pytest.mark.parametrize(("n", "plan"), [(2, "searched"), (4, "alternate")])
def test_moe_forwards_as_two_strands_match_sequential_forwards(n, plan):
    problems = _problems(launch(_strands_moe_cases.forward_only_matches_sequential, n, plan, 3, "ring", timeout=300))
    assert not problems, "\n".join(problems[:12])


@pytest.mark.parametrize(("stage", "plan", "n", "usable"), [
    ("dispatch + experts", "alternate", 4, True),  # the peers wait in the combine's exchange (empty messages skipped)
    ("shared experts", "alternate", 3, True),      # ... in the dispatch's backward exchange
    ("router", "searched", 2, False),              # ... in the whole all-to-all of the expert sizes: not servable
])
def test_a_moe_stage_failing_on_one_rank_is_told_to_every_rank_and_drained_where_it_can_be(stage, plan, n, usable):
    results = launch(_strands_moe_cases.one_rank_fails, n, stage, plan, timeout=300)
    problems = _strands_cases.told_and_after(results, usable)  # not usable: declared dead on every rank, by name
    assert not problems, "\n".join(problems)
