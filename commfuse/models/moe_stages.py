"""A mixture-of-experts block under expert parallelism cut into stages for ``commfuse.strands``.

Each rank of the expert-parallel group holds tokens of its own (attention is data parallel, its weights
replicated) and E/N of the E experts (rank r the experts r*E/N .. (r+1)*E/N - 1). :func:`moe_ep_stages` cuts
the block in five stages:

================== ============================================================== ==========================
stage              forward                                                        transfers
================== ============================================================== ==========================
attention          ``h = x + attend(x @ wqkv split in q, k, v) @ wo``, causal      none
router             top-k of ``h @ router^T``; h's rows sorted by expert           none
dispatch + experts ``SwiGLU(A2A(rows) @ w13)``, each source as it arrives         all-to-all (backward too)
combine            ``A2A(act @ w2)``, un-permuted, weighted by the gate           all-to-all (backward too)
shared experts     ``h + routed + SwiGLU(h @ shared_w13) @ shared_w2``            none
================== ============================================================== ==========================

The two stages with transfers are ``commfuse.nn.moe.dispatch_experts`` and ``experts_combine``, each
differentiable on its own with a backward that is an overlapped exchange. Norms are left out (they change no
transfer). Each stage passes on what a later stage needs (the residual, the gate, the sort, the counts) in its
output tuple.

Gradients: the experts' are those of the mean of the ranks' losses (every rank's rows summed, divided by N, as
``commfuse.nn.MoE`` gives them); the replicated weights' (attention, router, shared experts) are this rank's
loss's alone: average them over the group after the backward (as DDP does), and every gradient is the mean's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from commfuse.errors import CommfuseValueError
from commfuse.fused.attention import attend
from commfuse.nn.moe import dispatch_experts, experts_combine, route, sort_by_expert
from commfuse.strands import Stage

__all__ = ["MOE_STAGES", "REPLICATED", "moe_ep_params", "moe_ep_stages"]

MOE_STAGES = ("attention", "router", "dispatch + experts", "combine", "shared experts")

#: The weights every rank holds whole; ``w13`` and ``w2`` are this rank's experts.
REPLICATED = ("wqkv", "wo", "router", "shared_w13", "shared_w2")


def moe_ep_params(rank: int, n: int, *, hidden: int, ffn: int, experts: int, seed: int = 7,
                  dtype=torch.float32) -> dict:
    """This rank's weights of the block: its ``experts / n`` experts' ``w13`` (local experts, hidden, 2 * ffn;
    the gate projection's columns, then the up projection's) and ``w2`` (local experts, ffn, hidden), cut from
    every expert drawn from ``seed``, and the replicated ``wqkv`` (hidden, 3 * hidden), ``wo`` (hidden,
    hidden), ``router`` (experts, hidden) and shared expert ``shared_w13`` (hidden, 2 * ffn), ``shared_w2``
    (ffn, hidden). Every world size sees one model; ``moe_ep_params(0, 1, ...)`` is the whole block, in
    ``commfuse.nn.moe.moe_reference``'s layout."""
    if n < 1 or not 0 <= rank < n or experts % n:
        raise CommfuseValueError(f"moe_ep_params: rank {rank} of world size {n}: the {experts} experts must "
                                 "divide over the ranks")
    g = torch.Generator().manual_seed(seed)
    full = {"wqkv": torch.randn(hidden, 3 * hidden, generator=g) / hidden ** 0.5,
            "wo": torch.randn(hidden, hidden, generator=g) / hidden ** 0.5,
            "router": torch.randn(experts, hidden, generator=g) / hidden ** 0.5,
            "w13": torch.randn(experts, hidden, 2 * ffn, generator=g) / hidden ** 0.5,
            "w2": torch.randn(experts, ffn, hidden, generator=g) / ffn ** 0.5,
            "shared_w13": torch.randn(hidden, 2 * ffn, generator=g) / hidden ** 0.5,
            "shared_w2": torch.randn(ffn, hidden, generator=g) / ffn ** 0.5}
    local = experts // n
    full["w13"] = full["w13"][rank * local:(rank + 1) * local]
    full["w2"] = full["w2"][rank * local:(rank + 1) * local]
    return {k: v.to(dtype).contiguous() for k, v in full.items()}


def _swiglu(h: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    gate, up = (h @ w13).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w2


def moe_ep_stages(params: dict, *, heads: int, topk: int, algorithm: str = "ring", group=None,
                  figures: dict | None = None) -> list[Stage]:
    """The block's five stages (:data:`MOE_STAGES`) over ``params`` (:func:`moe_ep_params`: this rank's
    experts, the rest whole). The first stage takes this rank's tokens x (batch, seq, hidden), the last
    returns the block's output, the same shape. ``algorithm``: the all-to-alls' (``commfuse.nn.MoE``'s
    grammar; ``auto`` wants the same token count on every rank). ``figures``: stage name -> ``(compute,
    comm)`` seconds of the forward, for the plan search."""
    p = params
    hidden = p["wo"].shape[0]
    experts, local_experts = p["router"].shape[0], p["w13"].shape[0]
    if hidden % heads:
        raise CommfuseValueError(f"moe_ep_stages: {heads} heads do not divide hidden size {hidden}")
    d = hidden // heads

    def attention(x):
        b, s = x.shape[:2]
        q, k, v = (t.reshape(b, s, heads, d) for t in (x @ p["wqkv"]).chunk(3, dim=-1))
        return x + attend(q, k, v, causal=True).reshape(b, s, hidden) @ p["wo"]

    def router(h):
        ht = h.reshape(-1, hidden)
        weights, chosen = route(ht, p["router"], topk)
        order, token, counts = sort_by_expert(chosen, experts)
        send_counts = counts.view(experts // local_experts, local_experts)
        return ht.index_select(0, token), weights.reshape(-1)[order], token, send_counts, h

    def dispatch(xs, gate, token, send_counts, h):
        acts, recv_counts = dispatch_experts(xs, p["w13"], send_counts, group=group, algorithm=algorithm)
        return acts, recv_counts, gate, token, send_counts, h

    def combine(acts, recv_counts, gate, token, send_counts, h):
        ys = experts_combine(acts, p["w2"], recv_counts, send_counts, group=group, algorithm=algorithm)
        routed = h.new_zeros(h.numel() // hidden, hidden).index_add(0, token, ys * gate.unsqueeze(-1))
        return routed.view_as(h), h

    def shared(routed, h):
        return h + routed + _swiglu(h, p["shared_w13"], p["shared_w2"])

    fns = dict(zip(MOE_STAGES, (attention, router, dispatch, combine, shared)))
    if figures is None:
        return [Stage(name, fn) for name, fn in fns.items()]
    return [Stage(name, fn, *figures[name]) for name, fn in fns.items()]
