"""Mixture-of-experts under expert parallelism on real gloo ranks: the fused layer against a one-process
reference that holds every expert (with each DeepSeek-style routing option too), the expert bias's update
against hand-computed values, uneven exchanges that post no empty message, and ranks that built different
layers named on every rank."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _moe_cases  # noqa: E402

from commfuse.errors import CommfuseValueError  # noqa: E402
from commfuse.launch import launch  # noqa: E402
from commfuse.nn import MoE, moe_reference  # noqa: E402
from commfuse.nn.moe import grouped_mm, grouped_mm_kind, grouped_wgrad_add_, route  # noqa: E402

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


@pytest.mark.parametrize("n", (2, 4))
def test_routing_options_equal_the_reference(n):
    """route_scale, a router bias, the expert bias, node-limited routing and shared experts, each and all at
    once (DeepSeek-V3-like), with skewed routing: outputs and every gradient equal the one-process reference."""
    algorithms = ["vanilla", "ring", "ring:2", "sliced:2"] if n == 2 else ["vanilla", "ring"]
    for rank, problems in enumerate(launch(_moe_cases.options_match_reference, n, algorithms, timeout=600)):
        assert problems == [], f"rank {rank}:\n" + "\n".join(problems)


@pytest.mark.parametrize("n", (2, 4))
def test_the_expert_bias_update_is_the_hand_computed_one(n):
    for rank, problems in enumerate(launch(_moe_cases.expert_bias_update, n, timeout=600)):
        assert problems == [], f"rank {rank}:\n" + "\n".join(problems)


def test_one_process_with_every_routing_option_is_the_reference():
    torch.manual_seed(0)
    options = dict(route_scale=2.5, router_bias=True, load_balance_coeff=1e-3, num_expert_groups=4,
                   num_limited_groups=2, shared_ffn_size=16)
    moe = MoE(8, 12, 8, 3, gating="sigmoid", **options)
    with torch.no_grad():
        moe.router_bias.normal_()
        moe.expert_bias.normal_(std=0.1)
    x = torch.randn(7, 8, requires_grad=True)
    y = moe(x)
    names = ("router", "w13", "w2", "router_bias", "shared_w13", "shared_w2")
    w = {name: getattr(moe, name).detach().clone().requires_grad_() for name in names}
    x2 = x.detach().clone().requires_grad_()
    want = moe_reference(x2, w["router"], w["w13"], w["w2"], 3, "sigmoid", router_bias=w["router_bias"],
                         expert_bias=moe.expert_bias, route_scale=2.5, num_expert_groups=4, num_limited_groups=2,
                         shared_w13=w["shared_w13"], shared_w2=w["shared_w2"])
    assert torch.equal(y, want)
    g = torch.randn_like(y)
    y.backward(g)
    want.backward(g)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-6)
    for name in names:
        torch.testing.assert_close(getattr(moe, name).grad, w[name].grad, rtol=1e-5, atol=1e-6)


def test_node_limited_routing_chooses_only_within_the_kept_groups():
    """Each token's experts lie in at most num_limited_groups groups, and those are its best groups by the sum
    of their two best biased scores (torchtitan's group score)."""
    torch.manual_seed(1)
    x, router, expert_bias = torch.randn(64, 8), torch.randn(16, 8), 0.1 * torch.randn(16)
    _, chosen = route(x, router, 4, "sigmoid", expert_bias=expert_bias, num_expert_groups=4, num_limited_groups=2)
    scores = torch.sigmoid(x @ router.t()) + expert_bias
    best = scores.view(64, 4, 4).topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices
    for t in range(64):
        assert set((chosen[t] // 4).tolist()) <= set(best[t].tolist()), t


@pytest.mark.parametrize("kwargs,message", [
    (dict(route_scale=0.0), "route_scale must be a positive finite number, got 0.0"),
    (dict(route_scale=float("nan")), "route_scale must be a positive finite number, got nan"),
    (dict(route_scale=True), "route_scale must be a positive finite number, got True"),
    (dict(router_bias=1), "router_bias must be True or False, got 1"),
    (dict(load_balance_coeff=0.0), "load_balance_coeff must be a positive finite number or None, got 0.0"),
    (dict(load_balance_coeff=-1e-3), "load_balance_coeff must be a positive finite number or None, got -0.001"),
    (dict(num_expert_groups=4), ("num_expert_groups and num_limited_groups together, got num_expert_groups=4, "
                                 "num_limited_groups=None")),
    (dict(num_limited_groups=2), "got num_expert_groups=None, num_limited_groups=2"),
    (dict(num_expert_groups=3, num_limited_groups=1), "num_expert_groups=3 does not divide the 8 experts"),
    (dict(num_expert_groups=8, num_limited_groups=1), "num_expert_groups=8 leaves 1 expert per group of the 8"),
    (dict(num_expert_groups=4, num_limited_groups=5), "num_limited_groups=5 is more than num_expert_groups=4"),
    (dict(num_expert_groups=4, num_limited_groups=0), "num_limited_groups must be a positive int, got 0"),
    (dict(num_expert_groups=4, num_limited_groups=1, topk=3),
     "topk=3 is more than the 2 experts of num_limited_groups=1 groups of 2"),
    (dict(shared_ffn_size=0), "shared_ffn_size must be a positive int or None, got 0"),
])
def test_bad_routing_options_are_named(kwargs, message):
    kwargs = dict(dict(hidden_size=8, ffn_size=4, experts=8, topk=2), **kwargs)
    with pytest.raises(CommfuseValueError, match=re.escape(message)):
        MoE(**kwargs)


def test_an_expert_bias_update_without_load_balancing_is_named():
    with pytest.raises(CommfuseValueError, match="load_balance_coeff=None"):
        MoE(8, 4, 2, 1).update_expert_bias()
    with pytest.raises(CommfuseValueError, match="router_bias was given, but the layer was built without it"):
        MoE(8, 4, 2, 1).load_experts(torch.zeros(2, 8), torch.zeros(2, 8, 8), torch.zeros(2, 4, 8),
                                     router_bias=torch.zeros(2))
