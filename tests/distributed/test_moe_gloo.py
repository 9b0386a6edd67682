"""Mixture-of-experts under expert parallelism on real gloo ranks: the fused layer against a one-process
reference that holds every expert, uneven exchanges that post no empty message, and ranks that built
different layers named on every rank."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _moe_cases  # noqa: E402

from commfuse.errors import CommfuseValueError  # noqa: E402
from commfuse.launch import launch  # noqa: E402
from commfuse.nn import MoE, moe_reference  # noqa: E402
from commfuse.nn.moe import grouped_mm, grouped_mm_kind, grouped_wgrad_add_  # noqa: E402

ALGORITHMS = ["vanilla", "sliced:2", "ring", "ring:2", "ring:3", "auto"]


@pytest.mark.parametrize("n", (2, 3, 4))
def test_moe_forward_and_backward_equal_the_reference(n):
    results = launch(_moe_cases.matches_reference, n, ALGORITHMS if n < 4 else ["vanilla", "sliced:4", "ring"],
                     timeout=600)
    for rank, problems in enumerate(results):
        assert problems == [], f"rank {rank}:\n" + "\n".join(problems)


def test_auto_cuts_each_block_in_two_at_two_ranks_when_half_a_block_still_clears_the_bar():
    """At two ranks the ring's one hop hides only behind the own block; auto takes ring:2 (each half's compute
    led by one half) when half a block still carries MIN_SLICE_BYTES, plain ring (gloo takes the ring at every
    size) below."""
    from commfuse.planning.calls import MIN_SLICE_BYTES

    small, large = MIN_SLICE_BYTES * 2 // (2 * 64 * 4), 2 * MIN_SLICE_BYTES * 2 // (2 * 64 * 4)
    for rank, got in enumerate(launch(_moe_cases.auto_takes, 2, timeout=300)):
        assert got[small]["taken"] == "ring", (rank, got)
        assert got[large]["taken"] == "ring:2" and "in two halves" in got[large]["reason"], (rank, got)
        assert got[small]["close"] and got[large]["close"], (rank, got)


def test_moe_forward_and_backward_equal_the_reference_with_the_pairwise_whole_all_to_all():
    """Where the transport lacks a whole all-to-all, vanilla's uneven exchanges run pairwise, skipping empty
    pairs."""
    results = launch(_moe_cases.matches_reference, 3, ["vanilla", "sliced:2"],
                     env={"COMMFUSE_PAIRWISE_ALL_TO_ALL": "1"}, timeout=600)
    for rank, problems in enumerate(results):
        assert problems == [], f"rank {rank}:\n" + "\n".join(problems)


@pytest.mark.parametrize("n", (2, 3))
def test_zero_row_exchanges_post_no_message(n):
    for rank, res in enumerate(launch(_moe_cases.uneven_no_empty_messages, n, timeout=300)):
        assert res["problems"] == [], f"rank {rank}:\n" + "\n".join(res["problems"])


@pytest.mark.parametrize("what,named", [("experts", "16 experts"), ("hidden", "hidden 12")])
def test_ranks_that_built_different_layers_are_named_on_every_rank(what, named):
    results = launch(_moe_cases.mismatched, 4, what, timeout=300)
    for rank, text in enumerate(results):
        assert text.startswith("MismatchError: "), f"rank {rank}: {text}"
        assert named in text and "moe.sizes" in text, f"rank {rank}: {text}"


def test_one_process_is_the_reference():
    torch.manual_seed(0)
    moe = MoE(8, 12, 4, 2)
    x = torch.randn(7, 8, requires_grad=True)
    y = moe(x)
    x2 = x.detach().clone().requires_grad_()
    w = [p.detach().clone().requires_grad_() for p in (moe.router, moe.w13, moe.w2)]
    want = moe_reference(x2, *w, 2)
    assert torch.equal(y, want)
    g = torch.randn_like(y)
    y.backward(g)
    want.backward(g)
    for got, ref in ((x.grad, x2.grad), (moe.router.grad, w[0].grad), (moe.w13.grad, w[1].grad),
                     (moe.w2.grad, w[2].grad)):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_grouped_gemm_equals_a_loop_over_experts_with_empty_groups():
    torch.manual_seed(0)
    counts = [3, 0, 5, 0]
    x, w = torch.randn(8, 16), torch.randn(4, 16, 8)
    want = torch.cat([x[a:a + c] @ w[e] for e, (a, c) in enumerate(zip([0, 3, 3, 8], counts))])
    torch.testing.assert_close(grouped_mm(x, w, counts), want, rtol=1e-6, atol=1e-6)
    dy = torch.randn(8, 8)
    wg = torch.zeros(4, 16, 8)
    grouped_wgrad_add_(wg, x, dy, counts)
    assert torch.equal(wg[1], torch.zeros(16, 8)) and torch.equal(wg[3], torch.zeros(16, 8))
    torch.testing.assert_close(wg[2], x[3:8].t() @ dy[3:8], rtol=1e-6, atol=1e-6)
    assert grouped_mm_kind("cpu", torch.float32) in ("torch.nn.functional.grouped_mm", "loop")


@pytest.mark.parametrize("kwargs,message", [
    (dict(hidden_size=8, ffn_size=4, experts=2, topk=3), "topk=3 is more than the 2 experts"),
    (dict(hidden_size=8, ffn_size=4, experts=4, topk=1, gating="relu"), "gating must be one of"),
    (dict(hidden_size=0, ffn_size=4, experts=4, topk=1), "hidden_size must be a positive int"),
])
def test_bad_configurations_are_named(kwargs, message):
    with pytest.raises(CommfuseValueError, match=message):
        MoE(**kwargs)


def test_an_input_of_the_wrong_width_is_named():
    with pytest.raises(CommfuseValueError, match="input has 6 features in its last dim, the layer's hidden size is 8"):
        MoE(8, 4, 2, 1)(torch.randn(3, 6))


def test_compiled_layer_runs_its_exchanges_at_a_graph_break():
    for rank, res in enumerate(launch(_moe_cases.compiled, 2, timeout=600)):
        assert res["equal"], f"rank {rank}: compiled MoE differs from eager"
        assert "sized on the host each call" in res["fullgraph"], f"rank {rank}: {res['fullgraph'][:500]}"
